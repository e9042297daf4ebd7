// core_impl.h — the router's pure parts (no I/O, no clock reads: time is passed in), unit-tested
// in tests/unit/test_router_*.c:
//   prefix.c   the global prefix index: block hash → bitmask of workers holding it
//   policy.c   the routing cost, worker choice, TTFT/TPOT prediction and admission decisions
//   qos.c      QoS classes (config parsing, class selection), reserved capacity, rate limits
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"
#include "base/hash.h"

// ---- prefix index (prefix.c) ------------------------------------------------------------------------
// An open-addressing map (linear probing, backward-shift deletion) from pd_hash128 to a uint64_t
// worker mask: bit w set = worker slot w holds the block. Chained hashes make a block hash name
// its whole prefix, so "worker w holds the first k blocks of a prompt" is k consecutive hits.
// Bounded: beyond max_entries new hashes are dropped (the view stays a subset of the truth).
typedef struct pd_router_prefix pd_router_prefix;

// NULL on OOM. max_entries > 0.
pd_router_prefix *pd_router_prefix_new(int64_t max_entries);
void pd_router_prefix_free(pd_router_prefix *p);  // NULL is a no-op
// Marks worker w (0..63) as holding h. PD_OK, PD_NOSPACE (full: dropped), PD_ERR_NOMEM.
pd_status pd_router_prefix_add(pd_router_prefix *p, pd_hash128 h, int w);
// Clears worker w's bit for h (entries with no worker left are deleted).
void pd_router_prefix_remove(pd_router_prefix *p, pd_hash128 h, int w);
// Forgets every block of worker w (ALL_CLEARED, reset, worker gone). O(capacity).
void pd_router_prefix_clear_worker(pd_router_prefix *p, int w);
// The worker mask of h (0 if unknown).
uint64_t pd_router_prefix_get(const pd_router_prefix *p, pd_hash128 h);
int64_t pd_router_prefix_n_entries(const pd_router_prefix *p);
// For each worker in `workers`, the number of leading blocks of hashes[0..n) it holds:
// out_n_blocks[w] for w in 0..63 (0 for workers outside the mask).
void pd_router_prefix_match(const pd_router_prefix *p, const pd_hash128 *hashes, int n,
                            uint64_t workers, int32_t out_n_blocks[64]);

// KV tiers below a worker's device pool (KV events with a "tier"): worker w holds h in tier
// `tier` (pd_wire_tier 1..3); removed when that tier evicts it. A block may be in several tiers.
pd_status pd_router_prefix_add_tier(pd_router_prefix *p, pd_hash128 h, int w, int tier);
void pd_router_prefix_remove_tier(pd_router_prefix *p, pd_hash128 h, int w, int tier);
uint64_t pd_router_prefix_get_tiers(const pd_router_prefix *p, pd_hash128 h);  // workers with h in a tier
// Blocks the index lists per worker slot w: out[w][0] in its device pool, out[w][t] in tier t
// (pd_wire_tier 1..3: dram, disk, redis). One walk of the whole index (for /status.json, not
// for routing).
void pd_router_prefix_count(const pd_router_prefix *p, int64_t out[64][4]);
// Like pd_router_prefix_match, counting a block held in the device pool or in any tier.
void pd_router_prefix_match_tiers(const pd_router_prefix *p, const pd_hash128 *hashes, int n, uint64_t workers,
                                  int32_t out_n_blocks[64]);

// Chained block hashes of the full blocks of tokens (as kv/ computes them for extra_key 0).
// out: (n_tokens / block_size) hashes, caller-provided. Returns the count.
int pd_router_hash_prompt(const int32_t *tokens, int n_tokens, int block_size, pd_hash128 *out);

// ---- routing cost and admission (policy.c) -------------------------------------------------------
// What the router knows of one candidate worker for one request.
typedef struct pd_router_cand {
    int idx;                       // worker slot
    int32_t n_prompt_tokens;       // this request's prompt
    int32_t n_hit_tokens;          // of it, predicted cached on this worker
    int32_t n_tier_hit_tokens;     // after those, predicted in one of its KV tiers (loaded, not computed)
    double tier_us_per_token;      // its measured tier load time per token; <= 0 = unknown
    int32_t n_running, n_waiting;  // last load report
    int64_t n_queued_prefill_tokens;  // prefill work ahead of us (max of report and own tracking)
    int32_t n_inflight;            // requests the router has in flight there
    double kv_free_frac;           // free KV blocks / total (1 if unknown)
    double prefill_tokens_per_s;   // measured (or the router's default)
    double decode_step_ms;         // measured (or the router's default)
    double ttft_ms_per_inflight;   // router-observed TTFT / (in flight at dispatch + 1); 0 = unknown
    int64_t n_capacity;            // requests it takes at once (seats + queue); 0 = unknown
    int32_t n_foreign;             // requests there that are not the router's (from the last report)
    int32_t n_kv_blocks_total;     // 0 = unknown
    int32_t n_blocks_needed;       // this request's KV blocks at most (prompt + max tokens)
    // The worker's link-aware model (wire/link.h, decode workers in disaggregated mode): its
    // predicted prefill time for this request's uncached tokens, local or handed off, whichever
    // the worker would choose. When present it replaces uncached / prefill rate in the TTFT model
    // and, converted at the worker's prefill rate, the uncached-token term of the cost.
    bool has_prefill_pred;
    double prefill_pred_ms;
} pd_router_cand;

// A worker's admission capacity in concurrent requests, from what it reports: its running-batch
// seats (max_num_seqs) plus the requests it queues beyond them (max_waiting) — exactly what it
// accepts before answering 503 itself. override > 0 (capacity_per_worker in --qos-config) wins;
// 0 = unknown (no report yet): the router then refuses nothing on capacity grounds.
int64_t pd_router_worker_capacity(int32_t max_seqs, int32_t max_waiting, int override);
// Whether candidate c can take one more request now: its occupancy — the router's own in-flight
// count there (exact and current) plus the requests the worker last reported beyond the router's
// (n_foreign: other clients; reports lag a heartbeat, so they are not used for our own) — is below
// its capacity, and the request's KV fits the worker's cache at all.
bool pd_router_has_room(const pd_router_cand *c);

// Cost weights, in "prefill-token equivalents". Defaults (pd_router_cost_params_default):
//   cost = w_prefill × (uncached prompt tokens + queued prefill tokens + tier-hit tokens × r)
//        (r = the tier load time of a token / its prefill time, at most 1; 1 when unmeasured:
//         a tier hit is priced at its load time, never as free as a device hit)
//        + w_run × running + w_wait × waiting + w_inflight × router in-flight
//        + (kv_free_frac < kv_low_frac ? kv_low_penalty : 0)
typedef struct pd_router_cost_params {
    double w_prefill;       // 1.0
    double w_run;           // 16: one running request ≈ slows each step like 16 prefill tokens
    double w_wait;          // 64
    double w_inflight;      // 16
    double kv_low_frac;     // 0.1
    double kv_low_penalty;  // 4096
    bool use_prefix;        // false for "load" routing (ignores n_hit_tokens)
} pd_router_cost_params;
pd_router_cost_params pd_router_cost_params_default(void);

double pd_router_cost(const pd_router_cost_params *p, const pd_router_cand *c);
// Index into cands of the cheapest candidate; ties go to the first at or after tie_start
// (round-robin among equals). -1 if n == 0.
int pd_router_pick(const pd_router_cost_params *p, const pd_router_cand *cands, int n,
                   unsigned tie_start);

// Predicted time to first token (ms): queued prefill work ahead plus our uncached tokens at the
// measured prefill rate, plus the step we join (at batch running + 1) once per waiting request
// ahead of us and once for our own first token:
//   ttft = (queued + (prompt - hit)) / rate × 1000 + step_ms × (running + 1) / max(running, 1) × (1 + waiting)
// unless the router has observed this worker: then its own measure, scaled to the load, is used:
//   ttft = ttft_ms_per_inflight × (inflight + 1)
// (self-calibrating; the reported rates are averages over the worker's last steps, stale when
// it idles, and carry no batch size).
// Predicted time per output token (ms) at the batch size we would make (pessimistic linear
// scaling from the measured step at the current batch):
//   tpot = step_ms × (running + 1) / max(running, 1)
double pd_router_predict_ttft_ms(const pd_router_cand *c);
double pd_router_predict_tpot_ms(const pd_router_cand *c);

// ---- QoS classes (qos.c) -------------------------------------------------------------------------
#define PD_ROUTER_MAX_CLASSES 8
#define PD_ROUTER_MAX_KEYS 256

typedef struct pd_router_class {
    char name[32];
    int priority;              // higher = more important; passed to the worker as "priority"
    double reserved_frac;      // share of capacity kept for this class (0..1)
    double slo_ttft_ms;        // 0 = none
    double slo_tpot_ms;        // 0 = none
    double rate_limit_rps;     // per API key; 0 = unlimited
    double rate_burst;         // bucket size (default max(1, rps))
} pd_router_class;

typedef struct pd_router_qos {
    pd_router_class classes[PD_ROUTER_MAX_CLASSES];
    int n_classes;
    int default_class;             // index
    int capacity_per_worker;       // > 0: fixed capacity per worker; 0 = each worker's reported one
    struct {
        char key[96];
        int class_idx;
    } keys[PD_ROUTER_MAX_KEYS];
    int n_keys;
} pd_router_qos;

// Built-in classes: premium (priority 2), standard (1), free (0), none with reserved capacity
// (a reserve only exists when a --qos-config asks for one); default "standard"; SLOs from the
// arguments; capacity_per_worker 0 (from the workers' reports).
void pd_router_qos_default(pd_router_qos *q, double slo_ttft_ms, double slo_tpot_ms);
// Parses a --qos-config document (see docs/router.md):
//   {"classes":[{"name":"premium","priority":2,"reserved_fraction":0.3,"slo_ttft_ms":500,
//                "slo_tpot_ms":100,"rate_limit_rps":0,"rate_burst":0}, ...],
//    "default_class":"standard","capacity_per_worker":32,
//    "api_keys":{"sk-a":"premium","sk-b":"free"}}
// Classes without SLOs inherit slo_ttft_ms / slo_tpot_ms. PD_OK or PD_ERR_INVALID (err says why).
pd_status pd_router_qos_parse(pd_router_qos *q, const char *json, double slo_ttft_ms,
                              double slo_tpot_ms, pd_err *err);
int pd_router_qos_find(const pd_router_qos *q, const char *name);  // -1 if none
// The class of a request: header x-priority (a class name) wins, then the API key's class, then
// the default. Either may be NULL.
int pd_router_qos_select(const pd_router_qos *q, const char *x_priority, const char *api_key);
// Reserved-capacity admission: may one more request of class c start, given inflight[i] requests
// of each class and `capacity` in total? A class may use free capacity except what higher-priority
// classes have reserved and are not using:
//   admit ⇔ Σ inflight + 1 + Σ_{h: prio(h) > prio(c)} max(0, reserved(h)·capacity − inflight[h])
//           ≤ capacity
bool pd_router_qos_admit(const pd_router_qos *q, int c, const int *inflight, int capacity);

// Token bucket (per API key): `rate` tokens/s up to `burst`. now_us is passed in.
typedef struct pd_router_bucket {
    double tokens;
    int64_t t_us;
} pd_router_bucket;
// Takes one token if available: true = allowed. rate <= 0: always allowed.
bool pd_router_bucket_take(pd_router_bucket *b, double rate, double burst, int64_t now_us);
