// policy.c — what a tier keeps: S3-FIFO or LRU over block hashes, with an exact byte capacity.
//
// S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23): a new key
// enters the small FIFO S (10% of the bytes) unless the ghost list G remembers it, then it enters
// the main FIFO M. A hit only bumps a 2-bit frequency. Eviction: when S holds more than its share,
// S's oldest item moves to M if it was hit while in S, else it is evicted and its key goes to G;
// otherwise M's oldest item is re-inserted at M's head with freq - 1 while its freq > 0, else
// evicted. One-hit wonders (a prompt's unique tail) thus leave quickly through S, while prefixes
// that come back (system prompts, chat histories) settle in M. LRU: one list, a hit moves to head.
//
// Items live in a node array linked into doubly-linked lists by index; a pd_map maps the hash to
// the node. The ghost list is a ring of hashes with a map from hash to its ring sequence number.
#include <stdlib.h>
#include <string.h>

#include "base/map.h"
#include "base/buf.h"
#include "kvtier/kvtier.h"

enum { Q_SMALL = 0, Q_MAIN = 1 };

typedef struct node {
    pd_hash128 key;
    uint64_t bytes;
    int32_t prev, next;  // -1: none
    uint8_t q, freq;
} node;

typedef struct qlist {
    int32_t head, tail;  // head: newest
    uint64_t bytes;
} qlist;

typedef struct idx_entry {
    pd_hash128 key;
    int32_t idx;
} idx_entry;

typedef struct ghost_entry {
    pd_hash128 key;
    uint64_t seq;
} ghost_entry;

struct pd_kvt_policy {
    pd_kvt_policy_kind kind;
    uint64_t capacity;
    pd_kvt_evict_fn on_evict;
    void *ud;
    node *nodes;
    int32_t n_nodes, cap_nodes, free_head;
    qlist q[2];
    pd_map index;  // key -> node
    pd_map ghost;  // key -> seq
    pd_hash128 *ring;
    uint64_t ring_cap, ring_seq;  // ring_seq: next sequence number; the ring holds [seq - cap, seq)
    pd_kvt_policy_stats st;
};

static uint64_t hkey(pd_hash128 h) {
    return pd_map_mix64(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull));
}

pd_kvt_policy *pd_kvt_policy_new(pd_kvt_policy_kind kind, uint64_t capacity, pd_kvt_evict_fn on_evict, void *ud) {
    if ((kind != PD_KVT_LRU && kind != PD_KVT_S3FIFO) || capacity == 0) return NULL;
    pd_kvt_policy *p = pd_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->kind = kind;
    p->capacity = capacity;
    p->on_evict = on_evict;
    p->ud = ud;
    p->free_head = -1;
    for (int i = 0; i < 2; i++) p->q[i].head = p->q[i].tail = -1;
    pd_map_params mp = {.entry_size = sizeof(idx_entry), .key_size = sizeof(pd_hash128)};
    pd_map_params gp = {.entry_size = sizeof(ghost_entry), .key_size = sizeof(pd_hash128)};
    if (pd_map_init(&p->index, &mp) != PD_OK || pd_map_init(&p->ghost, &gp) != PD_OK) {
        pd_free(p);
        return NULL;
    }
    p->st.capacity = capacity;
    return p;
}

void pd_kvt_policy_free(pd_kvt_policy *p) {
    if (!p) return;
    pd_map_fini(&p->index);
    pd_map_fini(&p->ghost);
    pd_free(p->nodes);
    pd_free(p->ring);
    pd_free(p);
}

static void unlink_node(pd_kvt_policy *p, int32_t i) {
    node *n = &p->nodes[i];
    qlist *q = &p->q[n->q];
    if (n->prev >= 0) p->nodes[n->prev].next = n->next;
    else q->head = n->next;
    if (n->next >= 0) p->nodes[n->next].prev = n->prev;
    else q->tail = n->prev;
    q->bytes -= n->bytes;
    n->prev = n->next = -1;
}

static void push_head(pd_kvt_policy *p, int32_t i, int qi) {
    node *n = &p->nodes[i];
    qlist *q = &p->q[qi];
    n->q = (uint8_t)qi;
    n->prev = -1;
    n->next = q->head;
    if (q->head >= 0) p->nodes[q->head].prev = i;
    q->head = i;
    if (q->tail < 0) q->tail = i;
    q->bytes += n->bytes;
}

static void ghost_add(pd_kvt_policy *p, pd_hash128 key) {
    // The ghost remembers about as many keys as the cache holds items (at least 64).
    uint64_t want = (uint64_t)(p->st.n_items > 64 ? p->st.n_items : 64);
    if (p->ring_cap < want) {
        // Grow: keep the newest entries (re-lay them at their seq % new_cap).
        uint64_t nc = want * 2;
        pd_hash128 *r = pd_calloc(nc, sizeof *r);
        if (!r) return;
        uint64_t lo = p->ring_seq > p->ring_cap ? p->ring_seq - p->ring_cap : 0;
        for (uint64_t s = lo; s < p->ring_seq; s++) r[s % nc] = p->ring[s % p->ring_cap];
        pd_free(p->ring);
        p->ring = r;
        p->ring_cap = nc;
    }
    if (p->ring_seq >= p->ring_cap) {  // the slot's old key falls out of the ghost
        pd_hash128 old = p->ring[p->ring_seq % p->ring_cap];
        ghost_entry *g = pd_map_find(&p->ghost, hkey(old), &old);
        if (g && g->seq == p->ring_seq - p->ring_cap) pd_map_del_entry(&p->ghost, g);
    }
    p->ring[p->ring_seq % p->ring_cap] = key;
    ghost_entry *g = pd_map_put(&p->ghost, hkey(key), &key, NULL);
    if (g) g->seq = p->ring_seq;
    p->ring_seq++;
}

static void drop_node(pd_kvt_policy *p, int32_t i, bool count) {
    node *n = &p->nodes[i];
    unlink_node(p, i);
    pd_map_del(&p->index, hkey(n->key), &n->key);
    p->st.bytes_used -= n->bytes;
    p->st.n_items--;
    if (count) {
        p->st.evictions++;
        if (p->on_evict) p->on_evict(p->ud, n->key, n->bytes);
    }
    n->next = p->free_head;
    p->free_head = i;
}

// Evicts exactly one item. false when empty.
static bool evict_one(pd_kvt_policy *p) {
    if (p->kind == PD_KVT_LRU) {
        if (p->q[Q_MAIN].tail < 0) return false;
        drop_node(p, p->q[Q_MAIN].tail, true);
        return true;
    }
    for (;;) {
        bool from_small = p->q[Q_SMALL].tail >= 0 &&
                          (p->q[Q_SMALL].bytes > p->capacity / 10 || p->q[Q_MAIN].tail < 0);
        if (from_small) {
            int32_t t = p->q[Q_SMALL].tail;
            node *n = &p->nodes[t];
            if (n->freq > 0) {  // reused while probationary: promote
                unlink_node(p, t);
                n->freq = 0;
                push_head(p, t, Q_MAIN);
                continue;
            }
            pd_hash128 key = n->key;
            drop_node(p, t, true);
            ghost_add(p, key);
            return true;
        }
        int32_t t = p->q[Q_MAIN].tail;
        if (t < 0) return false;
        node *n = &p->nodes[t];
        if (n->freq > 0) {
            n->freq--;
            unlink_node(p, t);
            push_head(p, t, Q_MAIN);
            continue;
        }
        drop_node(p, t, true);
        return true;
    }
}

bool pd_kvt_policy_contains(const pd_kvt_policy *p, pd_hash128 key) {
    return pd_map_find(&p->index, hkey(key), &key) != NULL;
}

bool pd_kvt_policy_seen_before(const pd_kvt_policy *p, pd_hash128 key) {
    return pd_kvt_policy_contains(p, key) || pd_map_find(&p->ghost, hkey(key), &key) != NULL;
}

static void touch(pd_kvt_policy *p, int32_t i) {
    node *n = &p->nodes[i];
    if (p->kind == PD_KVT_LRU) {
        unlink_node(p, i);
        push_head(p, i, Q_MAIN);
    } else if (n->freq < 3) {
        n->freq++;
    }
}

bool pd_kvt_policy_get(pd_kvt_policy *p, pd_hash128 key) {
    idx_entry *e = pd_map_find(&p->index, hkey(key), &key);
    if (!e) {
        p->st.misses++;
        return false;
    }
    p->st.hits++;
    touch(p, e->idx);
    return true;
}

pd_status pd_kvt_policy_put(pd_kvt_policy *p, pd_hash128 key, uint64_t bytes) {
    idx_entry *e = pd_map_find(&p->index, hkey(key), &key);
    if (e) {
        touch(p, e->idx);
        return PD_OK;
    }
    if (bytes == 0 || bytes > p->capacity) {
        p->st.rejected_too_big++;
        return PD_NOSPACE;
    }
    while (p->st.bytes_used + bytes > p->capacity)
        if (!evict_one(p)) return PD_ERR_NOMEM;  // cannot happen: bytes <= capacity
    int32_t i;
    if (p->free_head >= 0) {
        i = p->free_head;
        p->free_head = p->nodes[i].next;
    } else {
        if (p->n_nodes == p->cap_nodes) {
            size_t cap = (size_t)p->cap_nodes;
            if (PD_ARRAY_RESERVE(p->nodes, cap, (size_t)p->n_nodes + 1) || cap > INT32_MAX) return PD_ERR_NOMEM;
            p->cap_nodes = (int32_t)cap;
        }
        i = p->n_nodes++;
    }
    idx_entry *ne = pd_map_put(&p->index, hkey(key), &key, NULL);
    if (!ne) {
        p->nodes[i].next = p->free_head;
        p->free_head = i;
        return PD_ERR_NOMEM;
    }
    ne->idx = i;
    node *n = &p->nodes[i];
    n->key = key;
    n->bytes = bytes;
    n->freq = 0;
    int qi = Q_MAIN;
    if (p->kind == PD_KVT_S3FIFO) {
        ghost_entry *g = pd_map_find(&p->ghost, hkey(key), &key);
        if (g) {
            p->st.ghost_hits++;
            pd_map_del_entry(&p->ghost, g);
        } else {
            qi = Q_SMALL;
        }
    }
    push_head(p, i, qi);
    p->st.bytes_used += bytes;
    p->st.n_items++;
    p->st.inserts++;
    return PD_OK;
}

bool pd_kvt_policy_remove(pd_kvt_policy *p, pd_hash128 key) {
    idx_entry *e = pd_map_find(&p->index, hkey(key), &key);
    if (!e) return false;
    drop_node(p, e->idx, false);
    return true;
}

void pd_kvt_policy_stats_get(const pd_kvt_policy *p, pd_kvt_policy_stats *out) {
    *out = p->st;
}
