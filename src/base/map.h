// map — the one hash map of pdserve: open addressing, linear probing, backward-shift deletion.
//
// What its users need (and so what it is):
//   * fixed-size entries stored inline (a key and a value in one caller struct), found by a 64-bit
//     hash the caller computes (a block hash's low word, a mixed request id, XXH3 of a string);
//   * keys compared as bytes (key_size bytes at the start of the entry), or by a caller function
//     when the key is not in the entry (the tokenizer's vocabulary keeps its strings in one pool
//     and stores only the token id in the map);
//   * inserts that cannot fail once room was reserved (kv/ and sched/ are sized up front and must
//     not fail half-way through a step), and growth on demand elsewhere;
//   * deletion without tombstones (Knuth's algorithm R: later members of the probe run shift back),
//     so lookups never degrade however long a server runs, and a bulk "remove where" that visits
//     every entry exactly once (the router drops a dead worker from every block).
//
// Layout: a power-of-two array of slots, each {u64 hash; entry} (stride rounded up to 8 bytes). A
// stored hash of 0 marks an empty slot; a caller hash of 0 is stored as 1 (only the probe start and
// the pre-compare use the hash, so this costs nothing but an extra compare on a 2^-64 event).
// The home slot is hash & mask, so callers pass a well-mixed hash (pd_map_mix64 for integers).
//
// Ownership: the map owns its slot array; entries are plain bytes (the map never follows a pointer
// inside one). An entry pointer stays valid until the next insert that grows the table or the next
// delete (which may move entries). Not thread-safe: one owner, or the owner's lock.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

// Equality for maps whose key is not (only) bytes in the entry. key: the pointer given to find/put.
typedef bool (*pd_map_eq_fn)(const void *entry, const void *key, void *ctx);

typedef struct pd_map_params {
    size_t entry_size;  // > 0
    size_t key_size;    // bytes at the entry's start that are the key (memcmp), when eq is NULL
    pd_map_eq_fn eq;    // optional: replaces the memcmp; then key_size must be 0 and put leaves
                        // the new entry zeroed for the caller to fill
    void *eq_ctx;       // passed to eq
    int max_load_pct;   // grow above this load, 25..90; 0 = 50
} pd_map_params;

typedef struct pd_map {
    unsigned char *slots;  // owned; cap * stride bytes
    size_t cap;            // power of two, or 0 before the first reserve
    size_t n;              // live entries
    size_t stride;         // 8 + entry_size rounded up to 8
    pd_map_params p;
} pd_map;

// Initialises an empty map (no allocation). PD_ERR_INVALID on bad params.
pd_status pd_map_init(pd_map *m, const pd_map_params *p);
void pd_map_fini(pd_map *m);  // frees the slots; the map may be re-initialised
void pd_map_clear(pd_map *m); // removes every entry, keeps the capacity

// Makes room so that n_entries entries in total fit without growing: after it succeeds, puts up
// to that total never fail. PD_ERR_NOMEM (map unchanged) when the table cannot be allocated or
// its size would overflow.
pd_status pd_map_reserve(pd_map *m, size_t n_entries);

// The entry with this key, or NULL.
void *pd_map_find(const pd_map *m, uint64_t hash, const void *key);

// Finds the entry with this key or inserts a new one. *existed (may be NULL) tells which. A new
// entry is zeroed, then (key_size > 0) its first key_size bytes are copied from key. Grows the
// table when needed; NULL on allocation failure (map unchanged).
void *pd_map_put(pd_map *m, uint64_t hash, const void *key, bool *existed);

// Removes the entry with this key; false when absent.
bool pd_map_del(pd_map *m, uint64_t hash, const void *key);
// Removes the entry at this pointer (from find/put/iteration).
void pd_map_del_entry(pd_map *m, void *entry);

// Calls pred once for every entry (in slot order, starting after an empty slot) and removes those
// for which it returns true. pred may modify the entry's value bytes, not its key.
typedef bool (*pd_map_pred_fn)(void *entry, void *ctx);
size_t pd_map_remove_if(pd_map *m, pd_map_pred_fn pred, void *ctx);  // returns how many removed

// Iteration: for (size_t i = 0; i < m->cap; i++) if ((e = pd_map_slot(m, i))) ... (no inserts or
// deletes during the loop; use pd_map_remove_if to delete while scanning).
static inline void *pd_map_slot(const pd_map *m, size_t i) {
    unsigned char *s = m->slots + i * m->stride;
    uint64_t h;
    __builtin_memcpy(&h, s, 8);
    return h ? s + 8 : NULL;
}
static inline size_t pd_map_len(const pd_map *m) { return m->n; }

// splitmix64's finaliser: a bijective mix for integer keys (sequential ids spread over the table).
static inline uint64_t pd_map_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

#ifdef __cplusplus
}
#endif
