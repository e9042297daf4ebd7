// check.c — pd_kv_check: verifies every invariant of the manager in O(n_blocks + map size). Meant
// for tests and debug builds (the property tests call it after every operation); it never mutates.
#include "kv/kv_impl.h"

#include <string.h>

#define FAIL(...) return pd_err_set(err, PD_ERR_INVALID, "kv_check: " __VA_ARGS__)

static pd_status check_freeq(const pd_kv_mgr *m, pd_err *err) {
    const pd_kv_block *b = m->blocks;
    int32_t n = m->params.n_blocks, s = m->freeq.sentinel, count = 0, prev = s;
    if (s != n) FAIL("sentinel %d != n_blocks %d", s, n);
    uint64_t stamp = 0;
    for (int32_t id = b[s].next; id != s; prev = id, id = b[id].next) {
        if (id < 0 || id >= n) FAIL("free queue link %d out of range", id);
        if (++count > n) FAIL("free queue has a cycle");
        if (b[id].prev != prev) FAIL("block %d: prev %d, expected %d", id, b[id].prev, prev);
        if (b[id].ref != 0) FAIL("block %d on the free queue has ref %d", id, b[id].ref);
        if (b[id].release_stamp < stamp) FAIL("free queue not in LRU order at block %d", id);
        stamp = b[id].release_stamp;
    }
    if (b[s].prev != prev) FAIL("sentinel prev %d, expected %d", b[s].prev, prev);
    if (count != m->freeq.n) FAIL("free queue holds %d blocks, counter says %d", count, m->freeq.n);
    return PD_OK;
}

static pd_status check_blocks(const pd_kv_mgr *m, pd_err *err) {
    int32_t n = m->params.n_blocks, bs = m->params.block_size, n_used = 0, n_cached_free = 0,
            n_cached = 0;
    for (int32_t id = 0; id < n; id++) {
        const pd_kv_block *b = &m->blocks[id];
        if (b->ref < 0) FAIL("block %d: negative ref %d", id, b->ref);
        bool on_queue = b->prev >= 0;
        if ((b->ref == 0) != on_queue || (b->next >= 0) != on_queue)
            FAIL("block %d: ref %d but %s the free queue", id, b->ref, on_queue ? "on" : "off");
        if (b->ref > 0) n_used++;
        if (!b->is_cached) continue;
        if (!m->params.enable_prefix_caching) FAIL("block %d cached with caching off", id);
        n_cached++;
        if (b->ref == 0) n_cached_free++;
        if (pd_kv_prefix_find(&m->prefix, b->hash) != id) FAIL("cached block %d not in map", id);
        // Every cached block is full: its hash is the hash of exactly block_size stored tokens.
        pd_hash128 h = m->hash_fn(&b->parent_hash, &m->block_tokens[(size_t)id * (size_t)bs], bs);
        if (!pd_hash128_eq(h, b->hash)) FAIL("cached block %d: hash does not match its tokens", id);
        if (b->parent_id < -1 || b->parent_id >= n) FAIL("block %d: bad parent %d", id, b->parent_id);
    }
    if (n_used + m->freeq.n != n) FAIL("free %d + used %d != total %d", m->freeq.n, n_used, n);
    if (n_cached_free != m->n_cached_free)
        FAIL("cached free blocks %d, counter says %d", n_cached_free, m->n_cached_free);
    if (m->params.enable_prefix_caching && n_cached != m->prefix.n)
        FAIL("%d cached blocks but the map holds %d entries", n_cached, m->prefix.n);
    return PD_OK;
}

static pd_status check_map(const pd_kv_mgr *m, pd_err *err) {
    const pd_map *map = &m->prefix.map;
    if (!map->slots) return PD_OK;
    int32_t n = 0;
    for (size_t i = 0; i < map->cap; i++) {
        const pd_kv_prefix_entry *e = pd_map_slot(map, i);
        if (!e) continue;
        n++;
        if (e->block_id < 0 || e->block_id >= m->params.n_blocks)
            FAIL("map slot %zu: block %d", i, e->block_id);
        const pd_kv_block *b = &m->blocks[e->block_id];
        if (!b->is_cached || !pd_hash128_eq(b->hash, e->key))
            FAIL("map entry for block %d does not match the block's hash", e->block_id);
        // Linear probing: the entry is found from its home slot.
        if (pd_map_find(map, e->key.lo, &e->key) != e) FAIL("map entry for block %d unreachable", e->block_id);
    }
    if (n != m->prefix.n || (size_t)n != pd_map_len(map))
        FAIL("map holds %d entries, counter says %d", n, m->prefix.n);
    return PD_OK;
}

pd_status pd_kv_check(const pd_kv_mgr *m, pd_err *err) {
    pd_status st = check_freeq(m, err);
    if (st == PD_OK) st = check_blocks(m, err);
    if (st == PD_OK) st = check_map(m, err);
    if (st == PD_OK && (m->ev_n < 0 || m->ev_n > m->params.n_events_max))
        return pd_err_set(err, PD_ERR_INVALID, "kv_check: %d events pending", m->ev_n);
    return st;
}
