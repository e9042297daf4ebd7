// freeq.c — the LRU free queue (vLLM FreeKVCacheBlockQueue), intrusive in pd_kv_block.
//
// A circular doubly-linked list whose links are block ids stored in the blocks themselves, closed
// by a sentinel element at index n_blocks:
//
//      sentinel ⇄ head ⇄ ... ⇄ tail ⇄ (back to sentinel)
//
// The sentinel removes every empty/head/tail special case, the links make removing a block from the
// middle O(1) (a prefix hit on a cached free block), and being intrusive means nothing is allocated
// after the pool is created. Ids rather than pointers keep the metadata relocatable and half the
// size on 64-bit hosts. A block off the queue has prev = next = -1, which the asserts rely on.
#include "kv/kv_impl.h"

void pd_kv_freeq_init(pd_kv_freeq *q, pd_kv_block *blocks, int32_t n_blocks) {
    q->blocks = blocks;
    q->sentinel = n_blocks;
    q->n = 0;
    blocks[n_blocks].prev = n_blocks;
    blocks[n_blocks].next = n_blocks;
    for (int32_t i = 0; i < n_blocks; i++) {
        blocks[i].prev = blocks[i].next = -1;
        pd_kv_freeq_push_tail(q, i);
    }
}

void pd_kv_freeq_push_tail(pd_kv_freeq *q, int32_t id) {
    pd_kv_block *b = q->blocks;
    PD_ASSERT(id >= 0 && id < q->sentinel && b[id].prev == -1 && b[id].next == -1);
    int32_t s = q->sentinel, last = b[s].prev;
    b[id].prev = last;
    b[id].next = s;
    b[last].next = id;
    b[s].prev = id;
    q->n++;
}

void pd_kv_freeq_remove(pd_kv_freeq *q, int32_t id) {
    pd_kv_block *b = q->blocks;
    PD_ASSERT(id >= 0 && id < q->sentinel && b[id].prev >= 0 && b[id].next >= 0);
    b[b[id].prev].next = b[id].next;
    b[b[id].next].prev = b[id].prev;
    b[id].prev = b[id].next = -1;
    q->n--;
}

int32_t pd_kv_freeq_pop_head(pd_kv_freeq *q) {
    int32_t id = pd_kv_freeq_head(q);
    if (id >= 0) pd_kv_freeq_remove(q, id);
    return id;
}

int32_t pd_kv_freeq_head(const pd_kv_freeq *q) {
    int32_t id = q->blocks[q->sentinel].next;
    return id == q->sentinel ? -1 : id;
}

int32_t pd_kv_freeq_tail(const pd_kv_freeq *q) {
    int32_t id = q->blocks[q->sentinel].prev;
    return id == q->sentinel ? -1 : id;
}

int32_t pd_kv_freeq_next(const pd_kv_freeq *q, int32_t id) {
    int32_t nx = q->blocks[id].next;
    return nx == q->sentinel || nx < 0 ? -1 : nx;
}
