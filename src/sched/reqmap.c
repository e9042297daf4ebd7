// reqmap.c — req_id -> request, so abort and update find a request in O(1) whatever its state.
// A pd_map (base/map.h) of {id, request}; ids are mixed (pd_map_mix64) because callers often use
// sequential ids. The map is reserved for one more entry in pd_sched_add before anything else
// changes, so the insert that follows cannot fail half-way through an add.
#include "sched/sched_impl.h"

typedef struct entry {
    uint64_t id;
    pd_sched_req *r;
} entry;

pd_status pd_sched_reqmap_init(pd_sched_reqmap *m) {
    m->n = 0;
    pd_status st = pd_map_init(&m->map, &(pd_map_params){.entry_size = sizeof(entry), .key_size = 8});
    return st == PD_OK ? pd_map_reserve(&m->map, 32) : st;
}

void pd_sched_reqmap_fini(pd_sched_reqmap *m) {
    pd_map_fini(&m->map);
    m->n = 0;
}

pd_sched_req *pd_sched_reqmap_find(const pd_sched_reqmap *m, uint64_t id) {
    const entry *e = pd_map_find(&m->map, pd_map_mix64(id), &id);
    return e ? e->r : NULL;
}

pd_status pd_sched_reqmap_reserve(pd_sched_reqmap *m) { return pd_map_reserve(&m->map, (size_t)m->n + 1); }

void pd_sched_reqmap_insert(pd_sched_reqmap *m, pd_sched_req *r) {
    bool existed;
    entry *e = pd_map_put(&m->map, pd_map_mix64(r->id), &r->id, &existed);
    PD_ASSERT(e && !existed);  // reserved by pd_sched_reqmap_reserve; ids are unique
    e->r = r;
    m->n++;
}

void pd_sched_reqmap_remove(pd_sched_reqmap *m, uint64_t id) {
    PD_ASSERT(pd_map_del(&m->map, pd_map_mix64(id), &id));
    m->n--;
}

size_t pd_sched_reqmap_cap(const pd_sched_reqmap *m) { return m->map.cap; }

pd_sched_req *pd_sched_reqmap_at(const pd_sched_reqmap *m, size_t i) {
    const entry *e = pd_map_slot(&m->map, i);
    return e ? e->r : NULL;
}
