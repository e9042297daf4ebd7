// kvtier — tiers of the KV cache below the device pool (issue 14; docs/design.md "KV tiers").
//
// Three parts, each usable alone and tested alone (tests/unit/test_kvtier.c):
//
//   page    one KV block serialised for a tier: a fixed little-endian header (magic, version,
//           model fingerprint, the block's chained hash and its parent, geometry, dtype, payload
//           length) then the payload — per layer, K then V, per KV head: a float32 scale and the
//           block's block_size x head_dim values in the page dtype (f32, bf16, fp8 e4m3, int8).
//           An XXH3-64 checksum covers header and payload. pd_kvt_page_decode accepts a page only
//           when length, magic, version, geometry, fingerprint, expected hash and checksum all hold:
//           a corrupted, truncated or foreign page is a miss and is never decoded.
//   policy  what a tier keeps: S3-FIFO (small FIFO 10% + main FIFO + ghost keys, Yang et al.,
//           SOSP'23) or LRU (the baseline it is measured against), keyed by the block hash, with an
//           exact byte capacity and every eviction counted. Admission to a lower tier:
//           pd_kvt_policy_seen_before says whether a key was seen before (ghost or resident).
//   store   a tier behind one interface (put / get / contains / stats): host DRAM
//           (pd_kvt_dram_new) and local disk (pd_kvt_disk_new: one O_DIRECT file per page under a
//           directory, written and read with io_uring; the index is rebuilt at start from the
//           files, and files of another model fingerprint are refused) and Redis
//           (pd_kvt_redis_new: the cluster pool shared by every worker; reconnect with backoff).
//
// Thread safety: a policy is not thread-safe (its store's lock guards it); stores are.
// Layering: kvtier includes base only; the engine reaches it through the tier connector
// (kvconn/tier.c, docs/design.md "KV tiers").
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"
#include "base/hash.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- page -----------------------------------------------------------------------------------------
typedef enum pd_kvt_dtype {
    PD_KVT_F32 = 1,
    PD_KVT_BF16 = 2,
    PD_KVT_FP8 = 3,   // e4m3fn, per-head scale = amax / 448
    PD_KVT_INT8 = 4,  // symmetric, per-head scale = amax / 127
} pd_kvt_dtype;
// "f32" | "bf16" | "fp8" | "int8" → the dtype; 0 when unknown.
pd_kvt_dtype pd_kvt_dtype_parse(const char *s);
const char *pd_kvt_dtype_name(pd_kvt_dtype d);

typedef struct pd_kvt_geom {
    int n_layers, n_kv_heads, head_dim, block_size;
} pd_kvt_geom;

#define PD_KVT_PAGE_MAGIC 0x5047564bu  // "KVGP" little-endian
#define PD_KVT_PAGE_VERSION 1u
#define PD_KVT_HDR_BYTES 96

typedef struct pd_kvt_page_info {
    pd_kvt_dtype dtype;
    pd_kvt_geom geom;
    uint64_t fingerprint;
    pd_hash128 hash, parent;
    uint64_t payload_bytes;
} pd_kvt_page_info;

// Exact page size (header + payload), 0 on bad geometry/dtype.
size_t pd_kvt_page_bytes(const pd_kvt_geom *g, pd_kvt_dtype d);

// Encodes one block. k[l], v[l]: the block's block_size rows of n_kv_heads*head_dim floats in
// layer l. out_len must be pd_kvt_page_bytes. PD_OK or PD_ERR_INVALID.
pd_status pd_kvt_page_encode(const pd_kvt_geom *g, pd_kvt_dtype d, uint64_t fingerprint, pd_hash128 hash,
                             pd_hash128 parent, const float *const *k, const float *const *v, void *out,
                             size_t out_len);

// A bf16 page straight from bf16 rows (a bf16 device cache's staged block), without an f32 round
// trip: byte for byte the page pd_kvt_page_encode(PD_KVT_BF16) makes from those values as floats.
pd_status pd_kvt_page_encode_bf16(const pd_kvt_geom *g, uint64_t fingerprint, pd_hash128 hash, pd_hash128 parent,
                                  const uint16_t *const *k, const uint16_t *const *v, void *out, size_t out_len);

// Why a page was refused (counted per tier).
typedef enum pd_kvt_bad {
    PD_KVT_PAGE_OK = 0,
    PD_KVT_BAD_TRUNCATED = 1,  // shorter/longer than its header says, or shorter than a header
    PD_KVT_BAD_FOREIGN = 2,    // magic, version, fingerprint, geometry or hash differ from expected
    PD_KVT_BAD_CHECKSUM = 3,   // bytes changed
} pd_kvt_bad;
// Parses and verifies the header and checksum only (no decode). fp / geom: what the page must be;
// expect_hash NULL: any hash. info (may be NULL) receives the header.
pd_kvt_bad pd_kvt_page_check(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                             const pd_hash128 *expect_hash, pd_kvt_page_info *info);
// The header alone (len >= PD_KVT_HDR_BYTES; nothing past it is read): identity and declared
// length, no checksum. The disk tier's index rebuild reads only each file's first block.
pd_kvt_bad pd_kvt_page_check_header(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                                    const pd_hash128 *expect_hash, pd_kvt_page_info *info);
// pd_kvt_page_check, then decodes into k[l], v[l] (same layout as encode). Writes nothing unless
// the page is accepted.
pd_kvt_bad pd_kvt_page_decode(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                              pd_hash128 expect_hash, float *const *k, float *const *v);
// A bf16 page into bf16 rows (k[l], v[l] as for pd_kvt_page_encode_bf16), no float round trip;
// the same checks as pd_kvt_page_decode, and PD_KVT_BAD_FOREIGN for a page of another dtype.
pd_kvt_bad pd_kvt_page_decode_bf16(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                                   pd_hash128 expect_hash, uint16_t *const *k, uint16_t *const *v);

// ---- policy ---------------------------------------------------------------------------------------
typedef enum pd_kvt_policy_kind { PD_KVT_LRU = 1, PD_KVT_S3FIFO = 2 } pd_kvt_policy_kind;
typedef struct pd_kvt_policy pd_kvt_policy;
typedef void (*pd_kvt_evict_fn)(void *ud, pd_hash128 key, uint64_t bytes);

typedef struct pd_kvt_policy_stats {
    int64_t hits, misses, inserts, evictions, ghost_hits, rejected_too_big;
    uint64_t bytes_used, capacity;
    int64_t n_items;
} pd_kvt_policy_stats;

// capacity: bytes. on_evict is called for every key pushed out (from inside put).
pd_kvt_policy *pd_kvt_policy_new(pd_kvt_policy_kind kind, uint64_t capacity, pd_kvt_evict_fn on_evict, void *ud);
void pd_kvt_policy_free(pd_kvt_policy *p);
// A lookup: true (a hit: frequency / recency updated) or false (a miss). Both counted.
bool pd_kvt_policy_get(pd_kvt_policy *p, pd_hash128 key);
// Resident without counting or updating anything.
bool pd_kvt_policy_contains(const pd_kvt_policy *p, pd_hash128 key);
// Whether key was seen before: resident, or in the ghost list (S3-FIFO). Admission test.
bool pd_kvt_policy_seen_before(const pd_kvt_policy *p, pd_hash128 key);
// Makes key resident with this size, evicting as needed so that bytes_used <= capacity always.
// Already resident: counts as an access. PD_OK, PD_NOSPACE (bytes > capacity: rejected, counted),
// PD_ERR_NOMEM.
pd_status pd_kvt_policy_put(pd_kvt_policy *p, pd_hash128 key, uint64_t bytes);
// Removes key without counting an eviction (its data turned out bad). false when absent.
bool pd_kvt_policy_remove(pd_kvt_policy *p, pd_hash128 key);
void pd_kvt_policy_stats_get(const pd_kvt_policy *p, pd_kvt_policy_stats *out);

// ---- stores ---------------------------------------------------------------------------------------
typedef struct pd_kvt_store pd_kvt_store;

typedef struct pd_kvt_store_stats {
    int64_t hits, misses, puts, put_failures, evictions, bad_pages;
    int64_t bytes_in, bytes_out;  // in: written to the tier; out: read back from it
    uint64_t bytes_used, capacity;
    int64_t n_items;
} pd_kvt_store_stats;

typedef struct pd_kvt_store_params {
    pd_kvt_geom geom;
    uint64_t fingerprint;
    uint64_t capacity;        // bytes (exact)
    pd_kvt_policy_kind policy;
    const char *dir;          // disk: the directory (created if missing)
    const char *secret;       // Redis: sent with AUTH after every connect (copied); NULL: none
    // DRAM: where page copies live (e.g. pinned host memory from the backend); NULL: pd_malloc.
    // Called under the store's lock. page_alloc may return NULL (the put fails, counted).
    void *(*page_alloc)(void *ud, size_t n);
    void (*page_free)(void *ud, void *p);
    void *page_ud;
} pd_kvt_store_params;

pd_kvt_store *pd_kvt_dram_new(const pd_kvt_store_params *p, pd_err *err);
pd_kvt_store *pd_kvt_disk_new(const pd_kvt_store_params *p, pd_err *err);
void pd_kvt_store_free(pd_kvt_store *s);
const char *pd_kvt_store_name(const pd_kvt_store *s);
// Stores a page (pd_kvt_page_check must accept it for this store's fingerprint and geometry;
// otherwise PD_ERR_INVALID). Copies. PD_OK, PD_NOSPACE (bigger than the tier), PD_ERR_IO.
pd_status pd_kvt_store_put(pd_kvt_store *s, pd_hash128 key, const void *page, size_t len);
// Reads the page of key into buf (cap bytes): PD_OK and *len, or PD_ERR_NOTFOUND (a miss: absent,
// or the stored bytes failed pd_kvt_page_check — then the entry is dropped and bad_pages counted).
pd_status pd_kvt_store_get(pd_kvt_store *s, pd_hash128 key, void *buf, size_t cap, size_t *len);
bool pd_kvt_store_contains(pd_kvt_store *s, pd_hash128 key);
// Without waiting on I/O (the engine thread): 1 held, 0 absent, -1 unknown (Redis: a round trip).
// A local store answers from its index, whose lock is never held across the store's reads/writes.
int pd_kvt_store_probe(pd_kvt_store *s, pd_hash128 key);
// Called (under the store's lock, from inside a put) for every key the store evicts.
void pd_kvt_store_set_evict_hook(pd_kvt_store *s, void (*fn)(void *ud, pd_hash128 key), void *ud);
void pd_kvt_store_stats_get(pd_kvt_store *s, pd_kvt_store_stats *out);
// Disk: files refused at start because they belong to another model (left in place, not indexed).
int64_t pd_kvt_disk_refused(pd_kvt_store *s);
// The remote tier: Redis at url "redis://HOST:PORT", shared by every worker of the same model
// (keys carry the fingerprint). Capacity is Redis's (maxmemory); p->capacity is ignored. A server
// that is down (at start or later) is not an error: operations miss / fail fast and reconnects are
// tried with exponential backoff (100 ms .. 5 s).
pd_kvt_store *pd_kvt_redis_new(const pd_kvt_store_params *p, const char *url, pd_err *err);
// Connections refused by the server's AUTH (a wrong or missing secret).
int64_t pd_kvt_redis_auth_failures(pd_kvt_store *s);
// Operations that found the server down or lost the connection.
int64_t pd_kvt_redis_down_misses(pd_kvt_store *s);

// ---- Redis keyspace notifications (notify.c): what the server removes by itself ---------------------
// One thread per Redis store on a second connection, authenticated like the first, subscribed to
// __keyspace@0__:pdkv:<fingerprint>:* (docs/design.md "KV tiers"). Needs notify-keyspace-events with
// K, e, x, g (or KA): CONFIG SET is tried once per connection when missing; refused: one warning,
// counted. Reconnects with backoff (100 ms .. 5 s).
typedef enum pd_kvt_notify_kind {
    PD_KVT_NOTIFY_BAD = -1,     // not a well-formed notification of one of our keys (counted, ignored)
    PD_KVT_NOTIFY_OTHER = 0,    // our key, an event that does not remove it ("set", ...): ignored
    PD_KVT_NOTIFY_EVICTED = 1,  // maxmemory policy
    PD_KVT_NOTIFY_EXPIRED = 2,  // a TTL
    PD_KVT_NOTIFY_DEL = 3,      // DEL / UNLINK / RENAME away
} pd_kvt_notify_kind;
#define PD_KVT_NOTIFY_MAX_CHANNEL 128
// A keyspace message: channel "__keyspace@<db>__:pdkv:<fp 16 hex>:<hash 32 hex>" (lower-case hex,
// exactly; fp must equal fingerprint), event the payload. *hash (may be NULL) is set for every kind
// but BAD. Lengths are checked before anything is read (channel <= 128 bytes, event <= 32).
pd_kvt_notify_kind pd_kvt_notify_parse(const char *channel, size_t clen, const char *event, size_t elen,
                                       uint64_t fingerprint, pd_hash128 *hash);
// Whether a notify-keyspace-events value delivers what we need; merge: flags plus what is missing.
bool pd_kvt_notify_flags_ok(const char *flags);
void pd_kvt_notify_flags_merge(const char *flags, char *out, size_t n);

typedef struct pd_kvt_notify_stats {
    int64_t evicted, expired, deleted;  // removals heard, by kind
    int64_t ignored;                    // malformed / foreign / oversized messages
    int64_t config_refused;             // CONFIG SET notify-keyspace-events refused by the server
    int64_t subscribes, drops;          // subscriptions made, connections lost
} pd_kvt_notify_stats;
typedef struct pd_kvt_notify pd_kvt_notify;
// fn(ud, hash, kind) runs on the notification thread for every removal of one of our keys.
typedef void (*pd_kvt_removed_fn)(void *ud, pd_hash128 hash, pd_kvt_notify_kind kind);
pd_kvt_notify *pd_kvt_notify_start(const char *host, int port, const char *secret, uint64_t fingerprint,
                                   pd_kvt_removed_fn fn, void *ud, pd_err *err);
void pd_kvt_notify_stop(pd_kvt_notify *n);  // joins the thread; NULL: no-op
void pd_kvt_notify_stats_get(pd_kvt_notify *n, pd_kvt_notify_stats *out);  // lock-free; NULL: zeros
// The Redis store's notification counters (zeros for other stores). Lock-free.
void pd_kvt_redis_notify_stats(pd_kvt_store *s, pd_kvt_notify_stats *out);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Whether a store would admit key under "seen at least twice": resident or remembered by its
// ghost list (DRAM, disk); always true for Redis (the pool takes every prefix).
bool pd_kvt_store_seen_before(pd_kvt_store *s, pd_hash128 key);

// ---- tiers: the chain below the device pool ----------------------------------------------------
// The scheduler side and the worker side of a tier connector, over up to PD_KVT_MAX_TIERS stores
// ordered fastest first (DRAM, disk, Redis). Tier worker threads (n_threads, default one) run every offload and load; callers
// (the engine thread) only queue work and read results: they never wait on a tier.
//
//   offload   a block completed or evicted in the device pool: its rows are copied into the job
//             (bounded queue; full = dropped, counted) and, on the tier thread, encoded (tier 0 at
//             f32, lower tiers at the configured dtype) and written: always to tier 0; to a lower
//             tier when that tier admits it (pd_kvt_store_seen_before, i.e. the second sighting,
//             or the ghost list), or at once for Redis.
//   match     how many leading blocks of a prompt (by chained hash) some tier holds, and the
//             predicted load time from the measured per-tier load bandwidth.
//   load      on the tier thread, ahead of every queued offload: each block from the fastest tier holding it, verified (a bad
//             page is a miss and the load stops there), decoded into the caller's block rows;
//             a lower-tier hit is promoted to tier 0. Completion through a callback (tier thread).
#define PD_KVT_MAX_TIERS 3
#define PD_KVT_MAX_WORKERS 8
typedef struct pd_kvt_tiers pd_kvt_tiers;

typedef struct pd_kvt_tiers_params {
    pd_kvt_geom geom;
    uint64_t fingerprint;
    pd_kvt_dtype dtype;                    // lower tiers (disk, Redis); tier 0 keeps f32
    pd_kvt_dtype dram_dtype;               // the DRAM tier's pages: 0 = f32; bf16 is exact for a bf16 cache
    pd_kvt_store *stores[PD_KVT_MAX_TIERS];  // owned from here on
    int n_stores;
    int queue_max;                         // pending offloads (default 1024)
    int n_threads;                         // tier workers running jobs in parallel (0: 1; at most
                                           // PD_KVT_MAX_WORKERS); loads still go before offloads
} pd_kvt_tiers_params;

// done: n_loaded leading blocks are in place (0..n); called on the tier thread.
typedef void (*pd_kvt_load_fn)(void *ud, uint64_t req_id, int n_loaded, int64_t load_us);

typedef struct pd_kvt_tier_stats {
    char name[16];
    pd_kvt_store_stats store;
    int64_t load_hist[24];  // block loads served by this tier, by latency: bucket i < 2^i us
} pd_kvt_tier_stats;

typedef struct pd_kvt_tiers_stats {
    int n_tiers;
    pd_kvt_tier_stats tier[PD_KVT_MAX_TIERS];
    int64_t offloads_queued, offloads_dropped, offloads_done, admitted_lower, refused_lower;
    int64_t loads, load_blocks, load_misses, promotions;
    int64_t events_dropped;
    pd_kvt_notify_stats remote_notify;  // the Redis tier's keyspace notifications (zeros without one)
} pd_kvt_tiers_stats;

pd_kvt_tiers *pd_kvt_tiers_new(const pd_kvt_tiers_params *p, pd_err *err);
void pd_kvt_tiers_free(pd_kvt_tiers *t);  // drains queued work, joins the thread, frees the stores
// k[l], v[l]: the block's rows in layer l (copied before return).
pd_status pd_kvt_tiers_offload(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, const float *const *k,
                               const float *const *v);
// Like offload, for rows that are not host floats yet (a device cache's staged bf16 copy): on the
// tier thread, fill(ud, rows) writes the block's rows (per layer, K then V, block_size rows of
// n_kv_heads*head_dim floats each) and returns true, or false to drop it (counted). fill is called
// exactly once when PD_OK is returned (rows NULL: out of memory, release only), never otherwise.
typedef bool (*pd_kvt_fill_fn)(void *ud, float *rows);
pd_status pd_kvt_tiers_offload_fill(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, pd_kvt_fill_fn fill,
                                    void *ud);
// Like offload, for a block held as bf16 rows (k[l], v[l]: block_size rows of n_kv_heads*head_dim
// bf16 values; the arrays and rows borrowed until release(ud), which the tier thread calls exactly
// once when PD_OK is returned, never otherwise). Tiers with bf16 pages are written straight from
// them (pd_kvt_page_encode_bf16); others from an f32 copy made on the tier thread.
pd_status pd_kvt_tiers_offload_bf16(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, const uint16_t *const *k,
                                    const uint16_t *const *v, void (*release)(void *ud), void *ud);
// Like offload_fill / offload_bf16, written to exactly the tiers of mask `only` (bit i: tier i;
// nonzero, no bit at or past n_stores) that do not hold the block yet, without the admission
// test: a tier above the chain that keeps its own pages (kvconn/tier.c's DRAM tier of a device
// cache) feeds the disk with its victims and Redis with every block.
pd_status pd_kvt_tiers_offload_fill_to(pd_kvt_tiers *t, uint32_t only, pd_hash128 hash, pd_hash128 parent,
                                       pd_kvt_fill_fn fill, void *ud);
pd_status pd_kvt_tiers_offload_bf16_to(pd_kvt_tiers *t, uint32_t only, pd_hash128 hash, pd_hash128 parent,
                                       const uint16_t *const *k, const uint16_t *const *v, void (*release)(void *ud),
                                       void *ud);
// Leading blocks of hashes[0..n) held by some tier (checks existence only). tier_of (may be NULL):
// per block, which tier would serve it. cost_us (may be NULL): predicted load time.
int pd_kvt_tiers_match(pd_kvt_tiers *t, const pd_hash128 *hashes, int n, int *tier_of, double *cost_us);
// Like match, but never waits (no Redis round trip, no lock held by I/O): leading blocks that some
// tier holds or may hold (pd_kvt_store_probe -1 counts as "may"); *n_sure (may be NULL): of those,
// the leading ones known to be held. The load finds out about the rest.
int pd_kvt_tiers_probe(pd_kvt_tiers *t, const pd_hash128 *hashes, int n, int *n_sure, double *cost_us);
// Queues a load of blocks hashes[0..n) into dst_k[i][l], dst_v[i][l] (arrays and rows borrowed
// until done). PD_OK: done is called exactly once.
pd_status pd_kvt_tiers_load(pd_kvt_tiers *t, uint64_t req_id, const pd_hash128 *hashes, int n,
                            float *const *const *dst_k, float *const *const *dst_v, pd_kvt_load_fn done, void *ud);
// Like load; block_done(ud, b, in_bf16) (may be NULL) runs on the tier thread as soon as block b
// is in place: in dst_bk[b] / dst_bv[b] (bf16 rows, in_bf16 true: a bf16 page, copied without a
// float round trip; only when dst_bk is given) or else in dst_k[b] / dst_v[b] (floats; those rows
// may be one scratch block reused for every b).
typedef void (*pd_kvt_block_fn)(void *ud, int b, bool in_bf16);
pd_status pd_kvt_tiers_load_ex(pd_kvt_tiers *t, uint64_t req_id, const pd_hash128 *hashes, int n,
                               float *const *const *dst_k, float *const *const *dst_v, uint16_t *const *const *dst_bk,
                               uint16_t *const *const *dst_bv, pd_kvt_block_fn block_done, pd_kvt_load_fn done,
                               void *ud);
// What the tiers now hold, for routers (the engine forwards them as KV events with the tier):
// STORED when a page was written to tier `tier`, REMOVED when that tier evicted it. A bounded
// ring (4096); on overflow the oldest are dropped and counted in events_dropped.
typedef struct pd_kvt_event {
    int tier;          // index into the chain
    bool is_stored;    // else removed
    pd_hash128 hash, parent;
} pd_kvt_event;
int pd_kvt_tiers_events_drain(pd_kvt_tiers *t, pd_kvt_event *out, int n_max);
const char *pd_kvt_tiers_name(pd_kvt_tiers *t, int tier);  // "dram", "disk", "redis"
// Waits (bounded by timeout_ms) until every queued job ran. true when idle. Tests and shutdown.
bool pd_kvt_tiers_flush(pd_kvt_tiers *t, int timeout_ms);
// Never waits on a store: the stores' counters are as of the tier thread's last job.
void pd_kvt_tiers_stats_get(pd_kvt_tiers *t, pd_kvt_tiers_stats *out);

#ifdef __cplusplus
}
#endif
