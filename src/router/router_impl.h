// router_impl.h — internals shared by the router's files:
//   server.c  pd_router_new/free, routes, registration, /health, /v1/models, /metrics
//   worker.c  the worker registry and the heartbeat (GET /internal/state, KV events → prefix index)
//   proxy.c   one client request: class, rate limit, tokenize, route, admit, forward, failover
//   status.c  GET /status (HTML) and /status.json, per-second latency history
//
//   pd_router ──owns──► rt_worker[PD_ROUTER_MAX_WORKERS] (slots; slot index = prefix-index bit)
//      │                    └── in-flight requests counted per worker
//      ├──owns──► rt_job list (one per proxied client request)
//      ├──owns──► pd_router_prefix, pd_metrics, pd_http_server, pd_http_client
//      └── heartbeat timer ──► one GET /internal/state per worker at a time
#pragma once

#include <jansson.h>

#include "http/client.h"
#include "http/http.h"
#include "metrics/metrics.h"
#include "router/core_impl.h"
#include "router/router.h"
#include "wire/control.h"
#include "wire/link.h"

struct event;

typedef struct rt_worker {
    pd_router *rt;              // back pointer (callbacks get the worker)
    int idx;                    // slot
    bool is_used;               // slot in use
    bool is_static;             // from the command line (never removed by deregister)
    bool is_healthy;            // in rotation
    bool has_state;             // at least one good /internal/state reply
    bool is_polling;
    char url[PD_WIRE_URL_MAX];
    pd_wire_role role;
    char model[PD_WIRE_MODEL_MAX];
    int32_t block_size;
    pd_wire_load load;
    uint64_t instance, seq_next;
    int n_poll_failures;        // in a row
    int64_t t_last_ok_us;
    pd_http_client_call *poll_call;
    char *poll_buf;             // owned: the state reply being read
    size_t poll_len, poll_cap;
    // router-side accounting
    int n_inflight;             // requests routed here and not finished
    double obs_step_ms;         // EWMA of observed inter-chunk gaps (0 = none yet)
    double obs_batch;           // EWMA of n_inflight when those gaps were observed
    double obs_ttft_per_inflight;  // EWMA of TTFT / (in flight at dispatch + 1), ms
    int64_t n_routed, n_failed;
    int64_t n_pred_query_tokens, n_pred_hit_tokens;  // router's predicted prefix hits
    int64_t n_prefix_query_base, n_prefix_hit_base;  // worker counters at registration (for rates)
    pd_metric *m_routed;        // pdserve_router_routed_total{worker=...}
    pd_wire_load prev_load;     // the previous report (rates on /status are deltas of counters)
    int inflight_at_poll;       // n_inflight when the current poll was sent
    int n_foreign;              // requests the worker reported beyond ours (other clients), last poll
    // cluster mode (--control nats://): found and refreshed by NATS presence, never polled
    bool is_nats;
    int64_t t_last_presence_us;
    int64_t t_resync_us;        // a resync request is out (0: none)
    int64_t pseq;               // the highest presence counter applied (older ones are replays)
    bool has_model;             // model_dm holds the worker's link-aware model (decode workers)
    pd_disagg_model model_dm;
} rt_worker;

typedef struct rt_class_metrics {
    pd_metric *ttft, *itl, *e2e, *rejected_slo, *rejected_capacity, *rejected_rate, *requests,
        *inflight;
} rt_class_metrics;

#define RT_HISTORY_S 120

// One second of latency history for /status.json.
// TTFT parts the router sees: its own (arrival → first upstream request), then the worker's four
// (wire/control.h pd_wire_ttft_part_names).
#define RT_N_TTFT_PARTS (1 + PD_WIRE_N_TTFT_PARTS)

typedef struct rt_sample {
    int64_t t_s;                               // unix second
    int n[PD_ROUTER_MAX_CLASSES];              // requests finished
    double ttft_ms_sum[PD_ROUTER_MAX_CLASSES];
    double ttft_ms_max[PD_ROUTER_MAX_CLASSES];
    double e2e_ms_sum[PD_ROUTER_MAX_CLASSES];
    int n_rejected;
    int n_rejected_class[PD_ROUTER_MAX_CLASSES];
    int n_ttft_part[RT_N_TTFT_PARTS];
    double ttft_part_ms_sum[RT_N_TTFT_PARTS];
    int64_t n_handoffs, handoff_bytes, n_fallbacks[PD_WIRE_N_FALLBACKS];  // from the workers' counters
    int router_inflight, running, waiting;     // queue depths: the largest seen in the second
} rt_sample;

typedef struct rt_job rt_job;

struct pd_router {
    struct event_base *base;
    pd_http_server *http;
    pd_http_client *client;       // proxied requests (long timeouts)
    pd_http_client *poll_client;  // heartbeats (short timeouts)
    pd_metrics *metrics;
    pd_router_prefix *prefix;
    pd_router_qos qos;
    pd_router_cost_params cost;
    pd_router_routing routing;
    char *auth_token;           // owned; NULL = open registration
    int heartbeat_ms, n_poll_failures_down, max_attempts, upstream_timeout_s;
    double default_prefill_tps, default_step_ms;
    struct event *heartbeat;
    rt_worker workers[PD_ROUTER_MAX_WORKERS];
    unsigned rr_next;
    pd_rng rng;
    uint64_t next_job_id;
    rt_job *jobs;               // doubly linked list of live jobs
    int inflight_by_class[PD_ROUTER_MAX_CLASSES];
    struct {
        char key[96];
        pd_router_bucket bucket;
    } buckets[PD_ROUTER_MAX_KEYS];
    int n_buckets;
    rt_class_metrics cm[PD_ROUTER_MAX_CLASSES];
    pd_metric *m_retries, *m_failovers, *m_decisions[4], *m_prefix_query, *m_prefix_hit,
        *m_workers_healthy, *m_poll_failures, *m_queue, *m_tokenize_failures, *m_kv_events;
    pd_metric *m_ttft_part[RT_N_TTFT_PARTS];  // pdserve_router_ttft_part_seconds{part=...}
    rt_sample history[RT_HISTORY_S];
    struct rt_nats *nats;         // cluster mode (router/nats.c); NULL = HTTP polling only
};

// ---- worker.c ----
// Adds (or refreshes) a worker; returns its slot or -1 (full / bad URL, err set).
int rt_worker_add(pd_router *r, const char *url, pd_wire_role role, const char *model,
                  int32_t block_size, bool is_static, pd_err *err);
// Removes a registered worker by URL. PD_OK or PD_ERR_NOTFOUND.
pd_status rt_worker_remove(pd_router *r, const char *url);
pd_status rt_heartbeat_start(pd_router *r);
void rt_worker_set_healthy(pd_router *r, rt_worker *w, bool ok);
// Applies a STATE document (poll reply, NATS presence, resync reply); true = a presence's events
// did not continue from where we are (ask for a resync from w->seq_next).
bool rt_worker_apply_state(pd_router *r, rt_worker *w, const char *buf, size_t len, bool is_presence, uint64_t since);

// ---- nats.c (cluster mode) ----
// Connects to NATS (token auth, or the nkey seed file when nkey_seed_file is not NULL; messages are
// signed and checked with token, the shared secret), subscribes to presence, starts the expiry
// timer. PD_OK or err.
pd_status rt_nats_start(pd_router *r, const char *url, const char *token, const char *nkey_seed_file, int expire_ms,
                        pd_err *err);
void rt_nats_stop(pd_router *r);
// For /metrics and /status: connected, disconnects, reconnects, presences applied, resyncs, expiries.
// rejected[RT_NATS_N_REJECTS]: messages refused, by reason (rt_nats_reject_names); bad_mac and
// inbox_full: dropped by the connection before any parsing (control/control.h).
#define RT_NATS_N_REJECTS 9
extern const char *const rt_nats_reject_names[RT_NATS_N_REJECTS];
typedef struct rt_nats_info {
    bool is_on, is_connected;
    int64_t disconnects, reconnects, presences, resyncs, expired;
    int64_t rejected[RT_NATS_N_REJECTS];
    int64_t bad_mac, inbox_full, verified;
} rt_nats_info;
void rt_nats_info_get(pd_router *r, rt_nats_info *out);
void rt_heartbeat_stop(pd_router *r);
// A proxied request could not reach worker w: count a failure (takes it out of rotation at once
// when connect failed: `is_hard`).
void rt_worker_note_failure(pd_router *r, int w, bool is_hard);
int rt_n_healthy(const pd_router *r);
// Workers in rotation that can decode (role both or decode): the ones requests can go to.
int rt_n_decode_healthy(const pd_router *r);
// A worker's capacity (pd_router_worker_capacity over its report and the QoS override); 0 = unknown.
int64_t rt_worker_capacity(const pd_router *r, const rt_worker *w);
// Σ over decode-capable workers in rotation; 0 if any of them is unknown (no refusal then).
int64_t rt_pool_capacity(const pd_router *r);

// ---- proxy.c ----
void rt_handle_completions(pd_http_req *req, void *ud);
void rt_handle_chat(pd_http_req *req, void *ud);
// Cancels every live job (router shutting down).
void rt_jobs_free_all(pd_router *r);

// ---- status.c ----
void rt_handle_status_html(pd_http_req *req, void *ud);
void rt_handle_status_json(pd_http_req *req, void *ud);
// Records a finished request (or a rejection when is_rejected) in the per-second history.
void rt_history_note(pd_router *r, int class_idx, double ttft_ms, double e2e_ms, bool is_rejected);
// Records one TTFT part (0 = router, 1.. = the worker's parts) of a finished first token.
void rt_ttft_note(pd_router *r, int part, double ms);
// Adds a worker's counter deltas since its previous report (handoffs, bytes, fallbacks).
void rt_history_disagg(pd_router *r, const pd_wire_load *now, const pd_wire_load *prev);
// Samples the queue depths (each heartbeat): requests in flight through the router, and the
// workers' reported running and waiting totals.
void rt_history_queue(pd_router *r, int router_inflight, int running, int waiting);
