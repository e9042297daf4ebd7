// kv — the KV-cache block manager: a pool of fixed-size blocks with ref counts, an LRU free queue,
// an automatic prefix cache keyed by chained block hashes, and per-request block tables.
//
// It is pure metadata (vLLM v1's KVCacheManager + BlockPool + FreeKVCacheBlockQueue): block *ids*
// only. The engine owns the device memory those ids index; kv/ does no I/O, takes no locks, makes
// no device calls and reads no clock. Single-threaded: the engine thread owns a pd_kv_mgr.
//
// Block life cycle (STYLE §6):
//
//            alloc (head of free queue; evicts its cached hash if any)
//   FREE ──────────────────────────────────────────────────────────────► USED (ref = 1)
//    ▲ ▲                                                                   │  ▲
//    │ │  release to ref 0: appended to the TAIL (still hash-addressable   │  │ touch (prefix hit,
//    │ └─ if it holds a cached full block: "cached" = free but reusable) ◄─┘  │ ref + 1; leaves the
//    └──────────────────── touch of a cached free block ────────────────────┘ free queue, O(1))
//
//   The free queue is intrusive and doubly linked with a sentinel, so taking a cached block out of
//   the middle on a hit is O(1) and nothing is allocated after pd_kv_mgr_new. Allocation takes the
//   head, so the least recently released block is evicted first. A request releases its blocks in
//   reverse order, so the tail of a sequence (least likely to be shared) is evicted before its head.
//
// Invariants (pd_kv_check verifies all of them): n_free + n_used = n_blocks; every block on the
// free queue has ref 0 and every ref-0 block is on it; the queue is in release order (LRU); every
// cached block is full and sits in the hash map under its own hash, which equals
// H(parent hash, its tokens); the map holds nothing else.
//
// Block tables are append-only for the life of a request (vLLM does the same): the engine's device
// page table is only ever extended, and a block computed twice by two concurrent requests is kept
// twice rather than swapped under a running request.
//
// A cached hit is never trusted on the hash alone: the manager stores each cached block's token ids
// and the identity (id + generation) of its parent block, and compares both before reusing it, so
// even a forced hash collision cannot return another prefix's KV.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"
#include "base/hash.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_kv_mgr pd_kv_mgr;

// Block hash function (test hook): must be deterministic. NULL in params means pd_hash_block.
typedef pd_hash128 (*pd_kv_hash_fn)(const pd_hash128 *parent, const int32_t *tokens, int n);

typedef struct pd_kv_params {
    int32_t n_blocks;            // blocks in the pool (> 0); default 1024
    int32_t block_size;          // tokens per block (> 0); default 16
    bool enable_prefix_caching;  // false = --no-prefix-caching; default true
    int32_t n_events_max;        // capacity of the KV event buffer; 0 disables events (default 0)
    pd_kv_hash_fn hash_fn;       // (optional, test hook) NULL = pd_hash_block
} pd_kv_params;

pd_kv_params pd_kv_params_default(void);

// Returns a new manager with every block free, or NULL (err says why: PD_ERR_INVALID for bad
// params, PD_ERR_NOMEM). out: owned by caller (pd_kv_mgr_free).
pd_kv_mgr *pd_kv_mgr_new(const pd_kv_params *p, pd_err *err);
// NULL is a no-op. Requests still holding blocks are the caller's bug but are not touched.
void pd_kv_mgr_free(pd_kv_mgr *m);

// ---- per-request block table -------------------------------------------------------------------
// Embedded in the caller's request (in-place object). The fields are read-only to the caller.
typedef struct pd_kv_seq {
    int32_t *block_ids;        // owned; (n_blocks) block ids, append-only while blocks are held
    int32_t n_blocks;
    size_t cap_blocks;
    pd_hash128 *block_hashes;  // owned; (n_hashes) chain hashes of the request's full token blocks
    int32_t n_hashes;          // grows as tokens are appended; survives pd_kv_free_request
    size_t cap_hashes;
    int32_t n_blocks_cached;   // leading blocks already registered in (or found in) the prefix cache
    int32_t parent_id;         // identity of block n_blocks_cached-1 for chaining (-1: root)
    uint32_t parent_gen;
    pd_hash128 root;           // pd_hash_root(extra_key)
} pd_kv_seq;

// extra_key separates caches (LoRA id, salt); 0 for the plain model. Never fails (no allocation).
void pd_kv_seq_init(pd_kv_seq *seq, uint64_t extra_key);
// Frees the arrays. The seq must hold no blocks (call pd_kv_free_request first): asserts.
// fini of a zeroed seq is a no-op.
void pd_kv_seq_fini(pd_kv_seq *seq);

// ---- request-level operations (vLLM KVCacheManager) ---------------------------------------------
// Finds the longest cached prefix of tokens[0..n_tokens) in whole blocks, leaving at least one token
// to compute (a full-prompt hit still recomputes the last block: logits need a forward), appends
// the hit blocks to the empty seq and touches them (ref + 1, out of the free queue).
//   PD_OK            *out_n_hit_tokens = hit blocks * block_size (0 with caching disabled)
//   PD_ERR_INVALID   the seq already holds blocks, or n_tokens < 0
//   PD_ERR_NOMEM     growing the seq's arrays failed (nothing touched)
// Counts queries and hits (tokens and blocks) in the stats.
pd_status pd_kv_get_computed_blocks(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens,
                                    int32_t n_tokens, int32_t *out_n_hit_tokens);

// Like pd_kv_get_computed_blocks for a seq that holds no blocks, but touches nothing and counts
// nothing: the prefix-aware scheduler uses it to rank waiting requests. Returns the hit in tokens,
// or a negative pd_status (PD_ERR_NOMEM) if the seq's hash list could not grow.
int32_t pd_kv_peek_computed(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens, int32_t n_tokens);

// Makes the seq's table cover n_tokens_computed + n_new_tokens token slots, allocating the missing
// blocks from the head of the free queue (evicting cached contents), all or nothing.
//   PD_OK            the table covers the slots (possibly without allocating)
//   PD_NOSPACE       not enough free blocks: nothing allocated (the scheduler preempts)
//   PD_ERR_NOMEM     growing the table failed: nothing allocated
//   PD_ERR_INVALID   negative counts
pd_status pd_kv_alloc_slots(pd_kv_mgr *m, pd_kv_seq *seq, int32_t n_tokens_computed,
                            int32_t n_new_tokens);

// Registers the seq's blocks that are now full of computed tokens (tokens[0..n_tokens_computed) is
// the request's whole token history: prompt then outputs) in the prefix cache. A block whose
// content is already cached under another id stays private to this request (tables are
// append-only). No-op with caching disabled. PD_OK, or PD_ERR_NOMEM if the hash list could not
// grow (nothing is lost: the next call catches up), PD_ERR_INVALID if the table is too short.
pd_status pd_kv_cache_full_blocks(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens,
                                  int32_t n_tokens_computed);

// Releases every block of the seq (ref - 1), last block first, and empties its table. The hash
// list is kept: a preempted request re-admitted later reuses it. Safe on an empty seq.
void pd_kv_free_request(pd_kv_mgr *m, pd_kv_seq *seq);

// Evicts every cached-but-free block from the prefix cache (vLLM reset_prefix_cache), emitting
// one ALL_CLEARED event. Blocks in use keep their content but stop being cached. Returns the number
// of blocks that stopped being cached.
int32_t pd_kv_reset_prefix_cache(pd_kv_mgr *m);

// ---- KV events for the router --------------------------------------------------------------------
// Values cross process boundaries: only append.
typedef enum pd_kv_event_type {
    PD_KV_EVENT_STORED = 1,       // a full block became cached: hash, parent_hash, n_tokens
    PD_KV_EVENT_REMOVED = 2,      // a cached block was evicted: hash
    PD_KV_EVENT_ALL_CLEARED = 3,  // forget every block of this worker (reset, or buffer overflow)
} pd_kv_event_type;

typedef struct pd_kv_event {
    pd_kv_event_type type;
    int32_t n_tokens;         // STORED: tokens in the block (block_size)
    pd_hash128 hash;          // STORED, REMOVED
    pd_hash128 parent_hash;   // STORED: the chain parent (pd_hash_root(key) for a first block)
    int32_t block_id;         // STORED: the block now holding it (its content is valid until the
                              // block is next allocated: the engine offloads it to a KV tier)
} pd_kv_event;

// Moves up to n_max pending events, oldest first, into out. Returns how many were written.
// NOTE: when the buffer overflows, pending events are discarded and replaced by one ALL_CLEARED,
// so a consumer's view stays a subset of the truth (safe for routing) and is rebuilt by later
// STORED events; stats.n_events_dropped counts the discarded ones.
int32_t pd_kv_events_drain(pd_kv_mgr *m, pd_kv_event *out, int32_t n_max);

// ---- counters, inspection and checks -------------------------------------------------------------
typedef struct pd_kv_stats {
    int32_t n_blocks;          // total
    int32_t n_free;            // ref 0 (includes cached)
    int32_t n_used;            // ref > 0
    int32_t n_cached;          // ref 0 and still hash-addressable
    int32_t n_cached_total;    // in the prefix map (cached free + cached in use)
    int64_t n_query_tokens;    // prefix-cache lookups (pd_kv_get_computed_blocks), in tokens
    int64_t n_hit_tokens;
    int64_t n_query_blocks;    // full blocks looked up (excluding the one always recomputed)
    int64_t n_hit_blocks;
    int64_t n_evictions;       // cached blocks whose content was dropped to reuse them
    int64_t n_collisions;      // hash matched but content or parent did not (hit rejected)
    int64_t n_events_dropped;
} pd_kv_stats;

void pd_kv_stats_get(const pd_kv_mgr *m, pd_kv_stats *out);
int32_t pd_kv_n_blocks(const pd_kv_mgr *m);
int32_t pd_kv_block_size(const pd_kv_mgr *m);
int32_t pd_kv_n_free(const pd_kv_mgr *m);
int32_t pd_kv_n_used(const pd_kv_mgr *m);
int32_t pd_kv_n_cached(const pd_kv_mgr *m);
bool pd_kv_is_prefix_caching(const pd_kv_mgr *m);
// Ref count of a block (-1 for an id out of range).
int32_t pd_kv_block_ref(const pd_kv_mgr *m, int32_t block_id);
// Blocks needed to hold n_tokens token slots.
static inline int32_t pd_kv_n_blocks_for(const pd_kv_mgr *m, int32_t n_tokens) {
    int64_t bs = pd_kv_block_size(m);
    return (int32_t)(((int64_t)n_tokens + bs - 1) / bs);
}

// Debug check of every invariant listed at the top (O(n_blocks)). PD_OK, or PD_ERR_INVALID with the
// first violation described in err.
pd_status pd_kv_check(const pd_kv_mgr *m, pd_err *err);

#ifdef __cplusplus
}
#endif
