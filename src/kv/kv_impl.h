// kv_impl.h — internals of kv/, shared by its .c files and by white-box tests (tests/unit/test_kv.c
// walks the free queue link by link). Nothing outside src/kv/ and its tests includes this.
//
//   freeq.c   the intrusive LRU free queue over pd_kv_block links           pd_kv_freeq_*
//   prefix.c  the hash -> block map (open addressing) and hit verification  pd_kv_prefix_*
//   pool.c    block alloc / touch / release / evict, events               pd_kv_pool_*
//   kv.c      params, new/free, the request-level API, stats              pd_kv_*
//   check.c   pd_kv_check
#pragma once

#include "base/map.h"
#include "kv/kv.h"

// Per-block metadata. Indexed by block id; index n_blocks is the free queue's sentinel.
typedef struct pd_kv_block {
    int32_t ref;              // requests holding the block; 0 = on the free queue
    int32_t prev, next;       // free-queue links (ids; the sentinel is n_blocks); -1 when off it
    uint32_t gen;             // bumped on every allocation: (id, gen) names one allocation
                              // lifetime, during which a full block's content never changes
    bool is_cached;           // in the prefix map: hash, parent_* and the tokens are valid
    int32_t parent_id;        // canonical parent block (-1: first block of a chain)
    uint32_t parent_gen;      // parent's gen when this block was cached
    pd_hash128 hash;          // valid if is_cached
    pd_hash128 parent_hash;   // valid if is_cached
    uint64_t release_stamp;   // value of the manager's release counter when it last hit ref 0
} pd_kv_block;

// Doubly-linked list threaded through blocks[].prev/next with blocks[sentinel] as the sentinel:
// empty when sentinel.next == sentinel. No allocation; every operation is O(1).
typedef struct pd_kv_freeq {
    pd_kv_block *blocks;  // borrowed; (n_blocks + 1) entries, the last being the sentinel
    int32_t sentinel;     // == n_blocks
    int32_t n;            // blocks on the queue
} pd_kv_freeq;

// Links blocks 0..n_blocks-1 in id order (head = 0). blocks must have n_blocks + 1 entries.
void pd_kv_freeq_init(pd_kv_freeq *q, pd_kv_block *blocks, int32_t n_blocks);
void pd_kv_freeq_push_tail(pd_kv_freeq *q, int32_t id);
// Returns the head's id, unlinked, or -1 when empty.
int32_t pd_kv_freeq_pop_head(pd_kv_freeq *q);
// Unlinks a block that is on the queue (asserts it is).
void pd_kv_freeq_remove(pd_kv_freeq *q, int32_t id);
// Head id / id after `id`, or -1 at the end.
int32_t pd_kv_freeq_head(const pd_kv_freeq *q);
int32_t pd_kv_freeq_next(const pd_kv_freeq *q, int32_t id);
int32_t pd_kv_freeq_tail(const pd_kv_freeq *q);

// Hash -> block id: a pd_map (base/map.h) of pd_kv_prefix_entry keyed by the 128-bit hash, whose
// low word is already uniform (XXH3) and so is the map hash. Reserved at creation for n_blocks
// entries (at most one per block), so an insert never allocates or fails.
typedef struct pd_kv_prefix_entry {
    pd_hash128 key;
    int32_t block_id;
} pd_kv_prefix_entry;

typedef struct pd_kv_prefix {
    pd_map map;  // of pd_kv_prefix_entry
    int32_t n;   // entries in use (== map's length)
} pd_kv_prefix;

pd_status pd_kv_prefix_init(pd_kv_prefix *p, int32_t n_blocks);
void pd_kv_prefix_fini(pd_kv_prefix *p);
// Block id cached under key, or -1.
int32_t pd_kv_prefix_find(const pd_kv_prefix *p, pd_hash128 key);
// Inserts key -> id; the key must be absent (asserts).
void pd_kv_prefix_insert(pd_kv_prefix *p, pd_hash128 key, int32_t block_id);
// Removes key (must be present: asserts).
void pd_kv_prefix_remove(pd_kv_prefix *p, pd_hash128 key);

struct pd_kv_mgr {
    pd_kv_params params;
    pd_kv_hash_fn hash_fn;
    pd_kv_block *blocks;     // owned; (n_blocks + 1), the last is the free queue's sentinel
    int32_t *block_tokens;   // owned; (n_blocks, block_size) token ids of cached blocks
    pd_kv_freeq freeq;
    pd_kv_prefix prefix;
    int32_t n_cached_free;   // ref 0 and is_cached
    uint64_t n_releases;     // release stamp source (LRU order check)
    pd_kv_event *events;     // owned; ring of params.n_events_max
    int32_t ev_head, ev_n;
    pd_kv_stats stats;       // counters (the gauges are filled in by pd_kv_stats_get)
};

// ---- pool.c --------------------------------------------------------------------------------------
// Takes the head of the free queue (evicting its cached content), ref = 1. -1 if none is free.
int32_t pd_kv_pool_alloc(pd_kv_mgr *m);
// ref + 1; a ref-0 block leaves the free queue.
void pd_kv_pool_touch(pd_kv_mgr *m, int32_t id);
// ref - 1; at 0 the block goes to the tail of the free queue (still cached if it was).
void pd_kv_pool_release(pd_kv_mgr *m, int32_t id);
// Makes a full block cached under hash (m->block_tokens gets its tokens); emits STORED.
void pd_kv_pool_cache(pd_kv_mgr *m, int32_t id, pd_hash128 hash, pd_hash128 parent_hash,
                      int32_t parent_id, uint32_t parent_gen, const int32_t *tokens);
// Removes a block from the prefix map (its KV stays valid for holders); REMOVED when emit is set.
void pd_kv_pool_uncache(pd_kv_mgr *m, int32_t id, bool emit);
void pd_kv_pool_emit(pd_kv_mgr *m, const pd_kv_event *ev);

// ---- prefix.c (verification) -----------------------------------------------------------------------
// The cached block that continues a verified chain with these tokens, or -1: the hash must be in the
// map, and the candidate's tokens and parent identity (parent_id, parent_gen; or the root for the
// first block) must match exactly. Counts rejected candidates in stats.n_collisions when count.
int32_t pd_kv_prefix_match(pd_kv_mgr *m, pd_hash128 hash, const int32_t *tokens,
                           int32_t parent_id, uint32_t parent_gen, pd_hash128 root, bool count);
