// wire/control — the JSON control messages between the router and its workers (docs/WIRE.md,
// "Control messages"). Encode/decode only: no I/O, no clock, no locks (bytes in, structs out).
//
// Messages (every one is a JSON object carrying "v": PD_WIRE_CONTROL_VERSION and "type"):
//
//   REGISTER    worker → router   POST /internal/register   (Authorization: Bearer <token>)
//     {"v":1,"type":"register","url":"http://127.0.0.1:8001","role":"both","model":"kjv-llama-6m",
//      "block_size":16}
//   DEREGISTER  worker → router   POST /internal/deregister (same auth)
//     {"v":1,"type":"deregister","url":"http://127.0.0.1:8001"}
//   STATE       router → worker   GET /internal/state?since=<seq>  (the reply body)
//     {"v":1,"type":"state","instance":"<16 hex>","model":"...","role":"both","block_size":16,
//      "load":{"running":2,"waiting":0,"waiting_prefill_tokens":0,"kv_blocks_total":512,
//              "kv_blocks_free":500,"kv_blocks_used":12,"kv_blocks_cached":40,
//              "prefill_tokens_per_s":5000.0,"decode_step_ms":4.2,
//              "prefix_query_tokens":1000,"prefix_hit_tokens":640,"requests_finished":17,
//              "max_seqs":64,"max_waiting":4096,
//              "disagg":{"handoffs":9,"handoff_bytes":123456,"handoff_us":8000,"local_short":3,
//                        "exports":0,"export_bytes":0,
//                        "fallbacks":{"unavailable":0,"timeout":0,"worker_died":1,"checksum":0,
//                                     "error":0}},
//              "ttft":{"n":12,"queue_ms":3.5,"prefill_ms":40.1,"transfer_ms":9.0,
//                      "first_decode_ms":2.2}},
//      "events":{"reset":false,"seq_next":42,
//                "list":[{"seq":40,"type":"stored","hash":"<32 hex>","parent":"<32 hex>",
//                         "n_tokens":16},
//                        {"seq":41,"type":"removed","hash":"<32 hex>"},
//                        {"seq":42,"type":"all_cleared"}]}}
//
// Event sequence numbers: the worker numbers its KV events 0, 1, 2, ... for the life of the
// process (pd_wire_kv_log does it). A poll passes since = the seq_next of the previous reply (0 at
// first); the reply lists the retained events with seq >= since and the new seq_next. When the
// worker cannot serve the request exactly (events older than its log were dropped, or since is
// beyond seq_next because the worker restarted) it sets "reset": true and lists everything it
// still holds: the consumer must forget everything it knew of that worker before applying the
// list. The view stays a subset of the truth, which is safe for routing. "instance" is a random id
// per worker process: a change also means "reset".
//
// Hashes are pd_hash128 (base/hash.h) as 32 lowercase hex digits: hi then lo, each %016 hex.
//
// Compatibility: decoders ignore unknown fields; missing numeric load fields read as 0 (or -1 for
// rates: "unknown"). A message whose "v" is greater than PD_WIRE_CONTROL_VERSION is rejected with
// PD_ERR_UNSUPPORTED; fields are only ever added within a version.
//
// Ownership: decode functions fill caller structs; strings and arrays they allocate belong to the
// struct and are released by the matching _fini. Encode functions return new jansson references
// (json_decref) or pd_malloc'ed text (pd_free).
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"
#include "base/hash.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_WIRE_CONTROL_VERSION 1

// Values cross process boundaries (but travel as strings): only append.
typedef enum pd_wire_role {
    PD_WIRE_ROLE_BOTH = 0,     // "both": prefill and decode (a colocated `serve` worker)
    PD_WIRE_ROLE_PREFILL = 1,  // "prefill"
    PD_WIRE_ROLE_DECODE = 2,   // "decode"
} pd_wire_role;

// "both" / "prefill" / "decode".
const char *pd_wire_role_str(pd_wire_role r);
// PD_OK, or PD_ERR_INVALID for an unknown name.
pd_status pd_wire_role_parse(const char *s, pd_wire_role *out);

// ---- hashes as hex -------------------------------------------------------------------------------
#define PD_WIRE_HASH_HEX_LEN 32
// Writes 32 hex digits and a NUL into out (33 bytes).
void pd_wire_hash_to_hex(pd_hash128 h, char out[PD_WIRE_HASH_HEX_LEN + 1]);
// PD_OK, or PD_ERR_PROTO unless s is exactly 32 hex digits.
pd_status pd_wire_hash_from_hex(const char *s, pd_hash128 *out);

// ---- REGISTER / DEREGISTER ------------------------------------------------------------------------
#define PD_WIRE_URL_MAX 256
#define PD_WIRE_MODEL_MAX 128

typedef struct pd_wire_register {
    char url[PD_WIRE_URL_MAX];      // base URL of the worker, "http://host:port" (no trailing /)
    pd_wire_role role;
    char model[PD_WIRE_MODEL_MAX];  // served model name ("" if unknown)
    int32_t block_size;             // KV block size in tokens (> 0)
} pd_wire_register;

// New reference, NULL on OOM.
json_t *pd_wire_register_to_json(const pd_wire_register *m);
// PD_OK; PD_ERR_PROTO (not JSON, wrong type, missing/oversized url, bad role, block_size <= 0),
// PD_ERR_UNSUPPORTED (newer version). err says which field.
pd_status pd_wire_register_decode(const char *buf, size_t len, pd_wire_register *out, pd_err *err);

// DEREGISTER carries only the url.
json_t *pd_wire_deregister_to_json(const char *url);
// out: PD_WIRE_URL_MAX bytes. PD_OK, PD_ERR_PROTO, PD_ERR_UNSUPPORTED.
pd_status pd_wire_deregister_decode(const char *buf, size_t len, char *out_url, pd_err *err);

// ---- LOAD report -------------------------------------------------------------------------------------
#define PD_WIRE_N_FALLBACKS 5
#define PD_WIRE_N_TTFT_PARTS 4
#define PD_WIRE_MAX_TIERS 3
typedef struct pd_wire_load {
    int32_t n_running;               // requests in the running batch
    int32_t n_waiting;               // requests queued, not yet started
    int64_t n_waiting_prefill_tokens;  // prompt tokens not yet computed (waiting + partial), 0 = unknown
    int32_t n_kv_blocks_total;
    int32_t n_kv_blocks_free;        // includes cached-but-free blocks
    int32_t n_kv_blocks_used;
    int32_t n_kv_blocks_cached;
    double prefill_tokens_per_s;     // measured prefill throughput (recent average); < 0 = unknown
    double decode_step_ms;           // measured time of one decode step at the current batch; < 0 = unknown
    int64_t n_prefix_query_tokens;   // cumulative prefix-cache lookups, in tokens
    int64_t n_prefix_hit_tokens;     // cumulative hits, in tokens
    int64_t n_requests_finished;     // cumulative
    // capacity (0 = not reported: the router falls back to its configured default)
    int32_t n_max_seqs;              // running-batch seats (the engine's max_num_seqs)
    int32_t n_max_waiting;           // requests it queues beyond them before refusing (503)
    // disaggregation, cumulative ("disagg" object)
    int64_t n_kv_handoffs;           // decode: prompts whose KV came from a prefill worker
    int64_t n_kv_handoff_bytes;
    int64_t kv_handoff_us;           // summed request-sent → KV-verified time
    int64_t n_kv_fallbacks[PD_WIRE_N_FALLBACKS];  // decode: local prefill after a failed handoff, by reason
    int64_t n_kv_local_short;        // decode: prefilled locally because short
    int64_t n_kv_exports;            // prefill: KV exports served
    int64_t n_kv_export_bytes;
    // time-to-first-token breakdown, cumulative over first tokens ("ttft" object, milliseconds)
    int64_t n_ttft;                  // first tokens counted
    double ttft_ms_sum[PD_WIRE_N_TTFT_PARTS];  // queue, prefill, transfer, first_decode
    // KV tiers below the device pool ("tiers" object; absent / n_tiers 0 without)
    int32_t n_tiers;
    char tier_names[PD_WIRE_MAX_TIERS][8];   // fastest first: "dram", "disk", "redis"
    int64_t tier_hits[PD_WIRE_MAX_TIERS], tier_misses[PD_WIRE_MAX_TIERS];
    int64_t n_tier_hit_tokens;       // cumulative prompt tokens loaded from tiers instead of computed
    int64_t tier_load_us;            // cumulative time of those loads (start → in the blocks)
} pd_wire_load;

// Fallback reasons in "disagg.fallbacks" (same order as the engine's pd_fallback_reason).
extern const char *const pd_wire_fallback_names[PD_WIRE_N_FALLBACKS];
// The parts of a TTFT (same order as ttft_ms_sum; see docs/router.md "TTFT breakdown").
extern const char *const pd_wire_ttft_part_names[PD_WIRE_N_TTFT_PARTS];

// A load with every count 0 and both rates -1 (unknown).
pd_wire_load pd_wire_load_default(void);

// ---- KV events ---------------------------------------------------------------------------------------
// Same numbering as kv/'s pd_kv_event_type (the worker can cast): only append.
typedef enum pd_wire_kv_event_type {
    PD_WIRE_KV_STORED = 1,       // "stored": hash, parent, n_tokens
    PD_WIRE_KV_REMOVED = 2,      // "removed": hash
    PD_WIRE_KV_ALL_CLEARED = 3,  // "all_cleared"
} pd_wire_kv_event_type;

// Where a STORED / REMOVED block lives ("tier" in the event; absent = the device pool).
typedef enum pd_wire_tier {
    PD_WIRE_TIER_DEVICE = 0,
    PD_WIRE_TIER_DRAM = 1,
    PD_WIRE_TIER_DISK = 2,
    PD_WIRE_TIER_REMOTE = 3,  // the Redis pool shared by workers
    PD_WIRE_N_TIERS = 4,
} pd_wire_tier;
extern const char *const pd_wire_tier_names[PD_WIRE_N_TIERS];  // "device", "dram", "disk", "redis"
// NULL (no "tier"): PD_WIRE_TIER_DEVICE; a name from the future: PD_WIRE_N_TIERS (consumers skip it)
pd_wire_tier pd_wire_tier_parse(const char *s);

typedef struct pd_wire_kv_event {
    uint64_t seq;
    pd_wire_kv_event_type type;
    pd_wire_tier tier;       // STORED, REMOVED: which tier of the worker holds / dropped it
    int32_t n_tokens;        // STORED
    pd_hash128 hash;         // STORED, REMOVED
    pd_hash128 parent_hash;  // STORED
} pd_wire_kv_event;

// ---- STATE (reply of GET /internal/state) ---------------------------------------------------------
typedef struct pd_wire_state {
    uint64_t instance;               // random per worker process
    char model[PD_WIRE_MODEL_MAX];
    pd_wire_role role;
    int32_t block_size;
    pd_wire_load load;
    bool is_reset;                   // "reset": forget this worker's KV view before applying events
    uint64_t seq_next;               // pass as since= on the next poll
    pd_wire_kv_event *events;        // (n_events); owned by the struct after decode; borrowed for encode
    int32_t n_events;
} pd_wire_state;

// Encodes a state. events/n_events are borrowed. New reference, NULL on OOM.
json_t *pd_wire_state_to_json(const pd_wire_state *s);
// The same, serialised compactly. *out owned by caller (pd_free), NUL-terminated; *out_len (may be
// NULL) excludes the NUL. PD_OK or PD_ERR_NOMEM.
pd_status pd_wire_state_encode(const pd_wire_state *s, char **out, size_t *out_len);
// Decodes a STATE reply into out (which it initialises; call pd_wire_state_fini afterwards even on
// failure). PD_OK, PD_ERR_PROTO (malformed; err says where), PD_ERR_UNSUPPORTED, PD_ERR_NOMEM.
pd_status pd_wire_state_decode(const char *buf, size_t len, pd_wire_state *out, pd_err *err);
// Frees events allocated by decode and zeroes the struct. Safe on a zeroed struct.
void pd_wire_state_fini(pd_wire_state *s);

// ---- the worker's event log ------------------------------------------------------------------------
// A bounded ring of numbered KV events, for the worker side of GET /internal/state: the engine's
// drained pd_kv_events are appended; each poll copies those with seq >= since. When the ring is
// full the oldest events are dropped (a poller that had not seen them gets "reset"). Not
// thread-safe: the caller serialises access.
typedef struct pd_wire_kv_log pd_wire_kv_log;

// capacity > 0 events. NULL on OOM or bad capacity. out: owned by caller (pd_wire_kv_log_free).
pd_wire_kv_log *pd_wire_kv_log_new(int32_t capacity);
void pd_wire_kv_log_free(pd_wire_kv_log *l);  // NULL is a no-op
// Appends one event and gives it the next seq (returned).
uint64_t pd_wire_kv_log_push(pd_wire_kv_log *l, pd_wire_kv_event_type type, pd_hash128 hash,
                             pd_hash128 parent_hash, int32_t n_tokens);
// The same for a block in a KV tier below the device pool.
uint64_t pd_wire_kv_log_push_tier(pd_wire_kv_log *l, pd_wire_kv_event_type type, pd_wire_tier tier, pd_hash128 hash,
                                  pd_hash128 parent_hash, int32_t n_tokens);
// Fills s->events / n_events / seq_next / is_reset for a poll with `since`, copying at most n_max
// events (the oldest first; if more remain, seq_next points at the first one not copied, so the
// next poll continues). s->events is allocated (pd_malloc) and owned by s: release it with
// pd_wire_state_fini. PD_OK or PD_ERR_NOMEM.
pd_status pd_wire_kv_log_read(const pd_wire_kv_log *l, uint64_t since, int32_t n_max,
                              pd_wire_state *s);
uint64_t pd_wire_kv_log_seq_next(const pd_wire_kv_log *l);

// ---- small helpers shared by router and worker ---------------------------------------------------
// Parses {"token_ids":[...]} (the reply of POST /internal/tokenize). *out owned by caller
// (pd_free). PD_OK, PD_ERR_PROTO, PD_ERR_NOMEM.
pd_status pd_wire_token_ids_decode(const char *buf, size_t len, int32_t **out, int32_t *out_n,
                                   pd_err *err);

#ifdef __cplusplus
}
#endif
