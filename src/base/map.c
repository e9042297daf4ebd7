// map.c — see map.h. Linear probing over a power-of-two table; deletion by backward shift.
#include "base/map.h"

#include <string.h>

static inline uint64_t slot_hash(const pd_map *m, size_t i) {
    uint64_t h;
    memcpy(&h, m->slots + i * m->stride, 8);
    return h;
}

static inline void set_hash(pd_map *m, size_t i, uint64_t h) { memcpy(m->slots + i * m->stride, &h, 8); }

static inline bool key_eq(const pd_map *m, const void *entry, const void *key) {
    if (m->p.eq) return m->p.eq(entry, key, m->p.eq_ctx);
    return memcmp(entry, key, m->p.key_size) == 0;
}

pd_status pd_map_init(pd_map *m, const pd_map_params *p) {
    memset(m, 0, sizeof *m);
    if (!p || p->entry_size == 0 || p->entry_size > ((size_t)1 << 20)) return PD_ERR_INVALID;
    if (p->eq ? p->key_size != 0 : (p->key_size == 0 || p->key_size > p->entry_size))
        return PD_ERR_INVALID;
    if (p->max_load_pct != 0 && (p->max_load_pct < 25 || p->max_load_pct > 90)) return PD_ERR_INVALID;
    m->p = *p;
    if (!m->p.max_load_pct) m->p.max_load_pct = 50;
    m->stride = 8 + ((p->entry_size + 7) & ~(size_t)7);
    return PD_OK;
}

void pd_map_fini(pd_map *m) {
    pd_free(m->slots);
    m->slots = NULL;
    m->cap = m->n = 0;
}

void pd_map_clear(pd_map *m) {
    if (m->slots) memset(m->slots, 0, m->cap * m->stride);
    m->n = 0;
}

// Entries that fit in cap slots without passing the load limit.
static size_t fits(const pd_map *m, size_t cap) { return cap / 100 * (size_t)m->p.max_load_pct + cap % 100 * (size_t)m->p.max_load_pct / 100; }

static size_t probe_empty(const pd_map *m, uint64_t h) {
    size_t mask = m->cap - 1, i = (size_t)h & mask;
    while (slot_hash(m, i)) i = (i + 1) & mask;
    return i;
}

static pd_status rehash(pd_map *m, size_t cap) {
    size_t bytes;
    if (pd_mul_overflow(cap, m->stride, &bytes)) return PD_ERR_NOMEM;
    unsigned char *s = pd_calloc(1, bytes);
    if (!s) return PD_ERR_NOMEM;
    pd_map old = *m;
    m->slots = s;
    m->cap = cap;
    for (size_t i = 0; i < old.cap; i++) {
        uint64_t h = slot_hash(&old, i);
        if (!h) continue;
        memcpy(m->slots + probe_empty(m, h) * m->stride, old.slots + i * old.stride, m->stride);
    }
    pd_free(old.slots);
    return PD_OK;
}

pd_status pd_map_reserve(pd_map *m, size_t n_entries) {
    if (m->cap && n_entries <= fits(m, m->cap)) return PD_OK;
    size_t cap = m->cap ? m->cap : 16;
    while (fits(m, cap) < n_entries || fits(m, cap) == 0) {
        if (cap > SIZE_MAX / 4) return PD_ERR_NOMEM;
        cap *= 2;
    }
    return rehash(m, cap);
}

// Slot holding the key, or the empty slot ending its probe run (cap must be > 0).
static size_t probe(const pd_map *m, uint64_t h, const void *key, bool *found) {
    size_t mask = m->cap - 1, i = (size_t)h & mask;
    for (;;) {
        uint64_t sh = slot_hash(m, i);
        if (!sh) {
            *found = false;
            return i;
        }
        if (sh == h && key_eq(m, m->slots + i * m->stride + 8, key)) {
            *found = true;
            return i;
        }
        i = (i + 1) & mask;
    }
}

void *pd_map_find(const pd_map *m, uint64_t hash, const void *key) {
    if (!m->n) return NULL;
    bool found;
    size_t i = probe(m, hash ? hash : 1, key, &found);
    return found ? m->slots + i * m->stride + 8 : NULL;
}

void *pd_map_put(pd_map *m, uint64_t hash, const void *key, bool *existed) {
    uint64_t h = hash ? hash : 1;
    bool found = false;
    size_t i = 0;
    if (m->cap) i = probe(m, h, key, &found);
    if (existed) *existed = found;
    if (found) return m->slots + i * m->stride + 8;
    if (!m->cap || m->n + 1 > fits(m, m->cap)) {
        if (m->n == SIZE_MAX || pd_map_reserve(m, m->n + 1) != PD_OK) return NULL;
        i = probe_empty(m, h);
    }
    unsigned char *e = m->slots + i * m->stride + 8;
    set_hash(m, i, h);
    memset(e, 0, m->stride - 8);
    if (m->p.key_size) memcpy(e, key, m->p.key_size);
    m->n++;
    return e;
}

// Empties slot i and shifts later members of its probe run back into the hole, unless an
// entry's home lies cyclically in (hole, j] (moving it would put it before its home).
static void delete_at(pd_map *m, size_t i) {
    size_t mask = m->cap - 1, hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t h = slot_hash(m, j);
        if (!h) break;
        size_t home = (size_t)h & mask;
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays) continue;
        memcpy(m->slots + hole * m->stride, m->slots + j * m->stride, m->stride);
        hole = j;
    }
    set_hash(m, hole, 0);
    m->n--;
}

bool pd_map_del(pd_map *m, uint64_t hash, const void *key) {
    if (!m->n) return false;
    bool found;
    size_t i = probe(m, hash ? hash : 1, key, &found);
    if (found) delete_at(m, i);
    return found;
}

void pd_map_del_entry(pd_map *m, void *entry) {
    size_t off = (size_t)((unsigned char *)entry - m->slots);
    PD_ASSERT(m->slots && off % m->stride == 8 && off / m->stride < m->cap);
    PD_ASSERT(slot_hash(m, off / m->stride));
    delete_at(m, off / m->stride);
}

// Starting just after an empty slot, no backward shift ever moves an entry across the scan's
// start, and a shift only moves not-yet-visited entries into the cursor slot or beyond it; so
// re-examining the cursor after a delete visits every entry exactly once.
size_t pd_map_remove_if(pd_map *m, pd_map_pred_fn pred, void *ctx) {
    if (!m->n) return 0;
    size_t mask = m->cap - 1, start = 0, removed = 0;
    while (slot_hash(m, start)) start++;  // exists: the load is at most 90%
    size_t i = (start + 1) & mask;
    for (size_t k = 1; k < m->cap;) {
        if (slot_hash(m, i) && pred(m->slots + i * m->stride + 8, ctx)) {
            delete_at(m, i);
            removed++;
            continue;  // slot i may now hold a shifted, unvisited entry
        }
        i = (i + 1) & mask;
        k++;
    }
    return removed;
}
