// prefix.c — the prefix cache's hash map (vLLM BlockHashToBlockMap) and hit verification.
//
// Map: a pd_map (base/map.h: open addressing, linear probing, backward-shift deletion, so
// lookups never degrade however long the server runs) keyed by the 128-bit hash, whose low word is
// the map hash. Reserved at creation for n_blocks entries at load <= 1/2 and never grown, since at
// most one entry exists per block: inserts cannot fail.
//
// One entry per hash: when a second block computes content whose hash is already present, the second
// block stays private to its request (kv.c). So a lookup yields at most one candidate, and
// pd_kv_prefix_match decides whether it really continues the caller's verified chain:
//
//   * its stored tokens equal the caller's tokens for this block, and
//   * its parent identity equals the caller's: the root (extra key) for a first block, else the
//     (block id, allocation generation) of the block the caller just verified.
//
// By induction the whole prefix is then equal token for token, whatever the hash function does.
#include "kv/kv_impl.h"

#include <string.h>

pd_status pd_kv_prefix_init(pd_kv_prefix *p, int32_t n_blocks) {
    p->n = 0;
    pd_status st = pd_map_init(&p->map, &(pd_map_params){.entry_size = sizeof(pd_kv_prefix_entry),
                                                         .key_size = sizeof(pd_hash128)});
    if (st == PD_OK) st = pd_map_reserve(&p->map, (size_t)(n_blocks > 0 ? n_blocks : 1));
    return st;
}

void pd_kv_prefix_fini(pd_kv_prefix *p) {
    pd_map_fini(&p->map);
    memset(p, 0, sizeof *p);
}

int32_t pd_kv_prefix_find(const pd_kv_prefix *p, pd_hash128 key) {
    const pd_kv_prefix_entry *e = pd_map_find(&p->map, key.lo, &key);
    return e ? e->block_id : -1;
}

void pd_kv_prefix_insert(pd_kv_prefix *p, pd_hash128 key, int32_t block_id) {
    PD_ASSERT(block_id >= 0);
    bool existed;
    pd_kv_prefix_entry *e = pd_map_put(&p->map, key.lo, &key, &existed);
    PD_ASSERT(e && !existed);  // reserved for every block at init: never grows
    e->block_id = block_id;
    p->n++;
}

void pd_kv_prefix_remove(pd_kv_prefix *p, pd_hash128 key) {
    PD_ASSERT(pd_map_del(&p->map, key.lo, &key));
    p->n--;
}

int32_t pd_kv_prefix_match(pd_kv_mgr *m, pd_hash128 hash, const int32_t *tokens,
                           int32_t parent_id, uint32_t parent_gen, pd_hash128 root, bool count) {
    int32_t id = pd_kv_prefix_find(&m->prefix, hash);
    if (id < 0) return -1;
    const pd_kv_block *b = &m->blocks[id];
    int32_t bs = m->params.block_size;
    bool ok = b->parent_id == parent_id &&
              (parent_id < 0 ? pd_hash128_eq(b->parent_hash, root) : b->parent_gen == parent_gen) &&
              memcmp(&m->block_tokens[(size_t)id * (size_t)bs], tokens, (size_t)bs * sizeof *tokens) == 0;
    if (!ok) {
        if (count) m->stats.n_collisions++;
        return -1;
    }
    return id;
}
