// pool.c — the block pool: ref counts, allocation from the LRU free queue with eviction of cached
// contents, and the KV event ring.
//
// Eviction order: allocation always takes the head of the free queue, the block released longest
// ago. A released block goes to the tail whether or not it is cached, as in vLLM: an uncached block
// is worthless but cheap to keep in order, and one rule keeps the LRU invariant checkable. A
// request releases its blocks last-first (kv.c), so the end of a sequence, least likely to be
// shared, is evicted before its start, and a child block is always evicted before its parent.
//
// Every allocation bumps the block's generation: (id, gen) then names one allocation lifetime, and
// a cached child records its parent's (id, gen), so a child whose parent was evicted and reused can
// never be matched under a new, different parent (prefix.c).
#include "kv/kv_impl.h"

#include <string.h>

void pd_kv_pool_emit(pd_kv_mgr *m, const pd_kv_event *ev) {
    int32_t cap = m->params.n_events_max;
    if (cap <= 0) return;
    if (m->ev_n == cap) {
        // Overflow: drop everything pending and tell the consumer to forget this worker's blocks;
        // later STORED events rebuild its view (see kv.h).
        m->stats.n_events_dropped += m->ev_n;
        m->ev_head = 0;
        m->ev_n = 0;
        pd_kv_event clr = {.type = PD_KV_EVENT_ALL_CLEARED};
        m->events[m->ev_n++] = clr;
        if (ev->type == PD_KV_EVENT_REMOVED) return;  // implied by ALL_CLEARED
        if (cap == 1) {
            m->stats.n_events_dropped++;
            return;
        }
    }
    m->events[(m->ev_head + m->ev_n) % cap] = *ev;
    m->ev_n++;
}

void pd_kv_pool_cache(pd_kv_mgr *m, int32_t id, pd_hash128 hash, pd_hash128 parent_hash,
                      int32_t parent_id, uint32_t parent_gen, const int32_t *tokens) {
    pd_kv_block *b = &m->blocks[id];
    PD_ASSERT(!b->is_cached && b->ref > 0);
    int32_t bs = m->params.block_size;
    memcpy(&m->block_tokens[(size_t)id * (size_t)bs], tokens, (size_t)bs * sizeof *tokens);
    b->is_cached = true;
    b->hash = hash;
    b->parent_hash = parent_hash;
    b->parent_id = parent_id;
    b->parent_gen = parent_gen;
    pd_kv_prefix_insert(&m->prefix, hash, id);
    pd_kv_event ev = {.type = PD_KV_EVENT_STORED, .n_tokens = bs, .hash = hash,
                      .parent_hash = parent_hash, .block_id = id};
    pd_kv_pool_emit(m, &ev);
}

void pd_kv_pool_uncache(pd_kv_mgr *m, int32_t id, bool emit) {
    pd_kv_block *b = &m->blocks[id];
    PD_ASSERT(b->is_cached);
    pd_kv_prefix_remove(&m->prefix, b->hash);
    b->is_cached = false;
    if (b->ref == 0) m->n_cached_free--;
    if (emit) {
        pd_kv_event ev = {.type = PD_KV_EVENT_REMOVED, .hash = b->hash};
        pd_kv_pool_emit(m, &ev);
    }
}

int32_t pd_kv_pool_alloc(pd_kv_mgr *m) {
    int32_t id = pd_kv_freeq_pop_head(&m->freeq);
    if (id < 0) return -1;
    pd_kv_block *b = &m->blocks[id];
    PD_ASSERT(b->ref == 0);
    if (b->is_cached) {
        pd_kv_pool_uncache(m, id, true);
        m->stats.n_evictions++;
    }
    b->ref = 1;
    b->gen++;
    return id;
}

void pd_kv_pool_touch(pd_kv_mgr *m, int32_t id) {
    pd_kv_block *b = &m->blocks[id];
    if (b->ref == 0) {
        pd_kv_freeq_remove(&m->freeq, id);
        if (b->is_cached) m->n_cached_free--;
    }
    b->ref++;
}

void pd_kv_pool_release(pd_kv_mgr *m, int32_t id) {
    pd_kv_block *b = &m->blocks[id];
    PD_ASSERT(b->ref > 0);
    if (--b->ref > 0) return;
    b->release_stamp = ++m->n_releases;
    pd_kv_freeq_push_tail(&m->freeq, id);
    if (b->is_cached) m->n_cached_free++;
}
