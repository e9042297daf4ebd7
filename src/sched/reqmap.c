// reqmap.c — req_id -> request, so abort and update find a request in O(1) whatever its state.
// Open addressing with linear probing; ids are hashed (mixed) because callers often use
// sequential ids. Deletion shifts the probe run back, so there are no tombstones. The table doubles
// in pd_sched_reqmap_reserve (called by pd_sched_add), keeping the load at most 1/2.
#include "sched/sched_impl.h"

static uint64_t mix(uint64_t x) {  // splitmix64 finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

pd_status pd_sched_reqmap_init(pd_sched_reqmap *m) {
    m->mask = 63;
    m->n = 0;
    m->slots = pd_calloc(m->mask + 1, sizeof *m->slots);
    return m->slots ? PD_OK : PD_ERR_NOMEM;
}

void pd_sched_reqmap_fini(pd_sched_reqmap *m) {
    pd_free(m->slots);
    m->slots = NULL;
    m->n = 0;
}

static uint64_t find_slot(pd_sched_req *const *slots, uint64_t mask, uint64_t id) {
    uint64_t i = mix(id) & mask;
    while (slots[i] && slots[i]->id != id) i = (i + 1) & mask;
    return i;
}

pd_sched_req *pd_sched_reqmap_find(const pd_sched_reqmap *m, uint64_t id) {
    return m->slots[find_slot(m->slots, m->mask, id)];
}

pd_status pd_sched_reqmap_reserve(pd_sched_reqmap *m) {
    if (2 * ((uint64_t)m->n + 1) <= m->mask + 1) return PD_OK;
    uint64_t cap = 2 * (m->mask + 1);
    pd_sched_req **slots = pd_calloc(cap, sizeof *slots);
    if (!slots) return PD_ERR_NOMEM;
    for (uint64_t i = 0; i <= m->mask; i++)
        if (m->slots[i]) slots[find_slot(slots, cap - 1, m->slots[i]->id)] = m->slots[i];
    pd_free(m->slots);
    m->slots = slots;
    m->mask = cap - 1;
    return PD_OK;
}

void pd_sched_reqmap_insert(pd_sched_reqmap *m, pd_sched_req *r) {
    PD_ASSERT(2 * ((uint64_t)m->n + 1) <= m->mask + 1);
    uint64_t i = find_slot(m->slots, m->mask, r->id);
    PD_ASSERT(!m->slots[i]);
    m->slots[i] = r;
    m->n++;
}

void pd_sched_reqmap_remove(pd_sched_reqmap *m, uint64_t id) {
    uint64_t hole = find_slot(m->slots, m->mask, id), j = hole;
    PD_ASSERT(m->slots[hole]);
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->slots[j]) break;
        uint64_t home = mix(m->slots[j]->id) & m->mask;
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays) continue;
        m->slots[hole] = m->slots[j];
        hole = j;
    }
    m->slots[hole] = NULL;
    m->n--;
}
