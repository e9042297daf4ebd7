// prefix.c — the prefix cache's hash map (vLLM BlockHashToBlockMap) and hit verification.
//
// Map: open addressing over a power-of-two table of (hash, block id) with linear probing. The
// 128-bit key is already uniformly distributed, so its low bits are the home slot. Sized at creation
// to >= 2 * n_blocks (load <= 1/2) and never resized, since at most one entry exists per block.
// Deletion shifts later entries of the probe run back (Knuth's algorithm R) instead of leaving
// tombstones, so lookups never degrade however long the server runs.
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
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n_blocks) cap <<= 1;
    p->slots = pd_malloc(cap * sizeof *p->slots);
    if (!p->slots) return PD_ERR_NOMEM;
    for (uint64_t i = 0; i < cap; i++) p->slots[i].block_id = -1;
    p->mask = cap - 1;
    p->n = 0;
    return PD_OK;
}

void pd_kv_prefix_fini(pd_kv_prefix *p) {
    pd_free(p->slots);
    memset(p, 0, sizeof *p);
}

static uint64_t find_slot(const pd_kv_prefix *p, pd_hash128 key) {
    uint64_t i = key.lo & p->mask;
    while (p->slots[i].block_id >= 0 && !pd_hash128_eq(p->slots[i].key, key)) i = (i + 1) & p->mask;
    return i;
}

int32_t pd_kv_prefix_find(const pd_kv_prefix *p, pd_hash128 key) {
    return p->slots[find_slot(p, key)].block_id;
}

void pd_kv_prefix_insert(pd_kv_prefix *p, pd_hash128 key, int32_t block_id) {
    uint64_t i = find_slot(p, key);
    PD_ASSERT(p->slots[i].block_id < 0 && block_id >= 0);
    PD_ASSERT((uint64_t)p->n < p->mask);  // never full: load stays <= 1/2
    p->slots[i].key = key;
    p->slots[i].block_id = block_id;
    p->n++;
}

void pd_kv_prefix_remove(pd_kv_prefix *p, pd_hash128 key) {
    uint64_t i = find_slot(p, key);
    PD_ASSERT(p->slots[i].block_id >= 0);
    // Backward shift: move each later entry of the run into the hole unless its home slot lies
    // cyclically in (hole, j], in which case moving it would put it before its home.
    uint64_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & p->mask;
        if (p->slots[j].block_id < 0) break;
        uint64_t home = p->slots[j].key.lo & p->mask;
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays) continue;
        p->slots[hole] = p->slots[j];
        hole = j;
    }
    p->slots[hole].block_id = -1;
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
