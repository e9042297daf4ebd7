// prefix.c — the router's global prefix index: block hash → bitmask of the workers that hold it.
//
// Design: one open-addressing table (linear probing) keyed by the 128-bit chained block hash,
// valued by a 64-bit worker mask. Deletion is backward-shift (no tombstones), so lookups never
// degrade after churn. The table doubles at 1/2 load and never shrinks. The hash's low word is
// already uniformly mixed (XXH3), so it indexes the table directly.
//
// The index is a *prediction*: it is fed by workers' STORED/REMOVED/ALL_CLEARED events (and by the
// router's own optimistic inserts after routing), so it may lag the truth by a heartbeat. Routing
// only uses it to rank workers; correctness never depends on it.
#include <string.h>

#include "router/core_impl.h"

typedef struct slot {
    pd_hash128 h;
    uint64_t mask;  // 0 = empty slot
} slot;

struct pd_router_prefix {
    slot *slots;    // (cap)
    int64_t cap;    // power of two
    int64_t n;
    int64_t max_entries;
};

pd_router_prefix *pd_router_prefix_new(int64_t max_entries) {
    if (max_entries <= 0) return NULL;
    pd_router_prefix *p = pd_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->cap = 1024;
    p->max_entries = max_entries;
    p->slots = pd_calloc((size_t)p->cap, sizeof *p->slots);
    if (!p->slots) {
        pd_free(p);
        return NULL;
    }
    return p;
}

void pd_router_prefix_free(pd_router_prefix *p) {
    if (!p) return;
    pd_free(p->slots);
    pd_free(p);
}

static int64_t find(const pd_router_prefix *p, pd_hash128 h) {
    int64_t m = p->cap - 1;
    for (int64_t i = (int64_t)(h.lo & (uint64_t)m);; i = (i + 1) & m) {
        if (!p->slots[i].mask) return -1;
        if (pd_hash128_eq(p->slots[i].h, h)) return i;
    }
}

static void insert_raw(slot *slots, int64_t cap, pd_hash128 h, uint64_t mask) {
    int64_t m = cap - 1;
    int64_t i = (int64_t)(h.lo & (uint64_t)m);
    while (slots[i].mask) i = (i + 1) & m;
    slots[i].h = h;
    slots[i].mask = mask;
}

static pd_status grow(pd_router_prefix *p) {
    int64_t cap = p->cap * 2;
    slot *s = pd_calloc((size_t)cap, sizeof *s);
    if (!s) return PD_ERR_NOMEM;
    for (int64_t i = 0; i < p->cap; i++)
        if (p->slots[i].mask) insert_raw(s, cap, p->slots[i].h, p->slots[i].mask);
    pd_free(p->slots);
    p->slots = s;
    p->cap = cap;
    return PD_OK;
}

pd_status pd_router_prefix_add(pd_router_prefix *p, pd_hash128 h, int w) {
    PD_ASSERT(w >= 0 && w < 64);
    int64_t i = find(p, h);
    if (i >= 0) {
        p->slots[i].mask |= 1ull << w;
        return PD_OK;
    }
    if (p->n >= p->max_entries) return PD_NOSPACE;
    if ((p->n + 1) * 2 > p->cap) {
        pd_status st = grow(p);
        if (st != PD_OK) return st;
    }
    insert_raw(p->slots, p->cap, h, 1ull << w);
    p->n++;
    return PD_OK;
}

// Deletes slot i and shifts later members of its probe run back (Knuth's algorithm R).
static void delete_at(pd_router_prefix *p, int64_t i) {
    int64_t m = p->cap - 1;
    int64_t j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!p->slots[j].mask) break;
        int64_t home = (int64_t)(p->slots[j].h.lo & (uint64_t)m);
        // move j into the hole at i unless its home lies cyclically in (i, j]
        bool in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            p->slots[i] = p->slots[j];
            i = j;
        }
    }
    p->slots[i].mask = 0;
    p->n--;
}

void pd_router_prefix_remove(pd_router_prefix *p, pd_hash128 h, int w) {
    int64_t i = find(p, h);
    if (i < 0) return;
    p->slots[i].mask &= ~(1ull << w);
    if (!p->slots[i].mask) {
        p->slots[i].mask = 1;  // keep it occupied while delete_at walks the run
        delete_at(p, i);
    }
}

void pd_router_prefix_clear_worker(pd_router_prefix *p, int w) {
    uint64_t bit = 1ull << w;
    // Clear bits first, then delete emptied slots; deleting while scanning forward could move an
    // unvisited entry behind the cursor, so rescan from the slot just shifted into.
    for (int64_t i = 0; i < p->cap;) {
        if (p->slots[i].mask & bit) {
            p->slots[i].mask &= ~bit;
            if (!p->slots[i].mask) {
                p->slots[i].mask = bit;  // occupied marker for delete_at
                delete_at(p, i);
                continue;  // slot i may now hold a shifted entry: look at it again
            }
        }
        i++;
    }
}

uint64_t pd_router_prefix_get(const pd_router_prefix *p, pd_hash128 h) {
    int64_t i = find(p, h);
    return i < 0 ? 0 : p->slots[i].mask;
}

int64_t pd_router_prefix_n_entries(const pd_router_prefix *p) { return p->n; }

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
