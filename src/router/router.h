// router — `pdserve router`: one OpenAI-compatible front door over a pool of pdserve workers.
//
// It speaks the same API as a worker (POST /v1/completions, /v1/chat/completions, GET /v1/models,
// /health, /metrics) and proxies each request to one worker, streaming SSE chunk by chunk. Around
// the proxy it adds:
//   * a worker registry: static --worker URLs plus POST /internal/register (bearer token), and a
//     heartbeat that polls every worker's GET /internal/state (load report + KV events, see
//     wire/control.h); N failed polls in a row take a worker out of rotation, a good poll brings
//     it back;
//   * routing (kv | load | round-robin | random): "kv" keeps a global prefix index (block hash →
//     workers holding it) fed by the workers' KV events and sends a request where the documented
//     cost (router/policy.c) is lowest;
//   * admission control: predicted TTFT / TPOT against the request's class SLO (503 + Retry-After
//     when it would miss), per-API-key rate limits (429), QoS classes with reserved capacity;
//   * failover: a worker that dies before the first byte → the request is re-sent elsewhere; one
//     that dies mid-stream → the request continues on another worker from prompt + generated ids,
//     so the client's stream has neither gaps nor duplicates;
//   * observability: Prometheus /metrics, GET /status (self-contained HTML) and /status.json.
//
// Layering: the router includes only base/, wire/, http/, net/ and metrics/. Everything it knows
// about workers comes over HTTP.
//
// Threads: everything runs on the thread of the event_base given to pd_router_new. Not
// thread-safe.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

struct event_base;

typedef struct pd_router pd_router;

typedef enum pd_router_routing {
    PD_ROUTER_ROUTING_KV = 0,           // prefix-aware cost (default)
    PD_ROUTER_ROUTING_LOAD = 1,         // least loaded (same cost without the prefix term)
    PD_ROUTER_ROUTING_ROUND_ROBIN = 2,
    PD_ROUTER_ROUTING_RANDOM = 3,
} pd_router_routing;

// "kv" / "load" / "round-robin" / "random" ↔ enum. parse: PD_OK or PD_ERR_INVALID.
const char *pd_router_routing_str(pd_router_routing r);
pd_status pd_router_routing_parse(const char *s, pd_router_routing *out);

#define PD_ROUTER_MAX_WORKERS 64

typedef struct pd_router_params {
    const char *host;               // default "127.0.0.1"; borrowed for the call
    int port;                       // 0 = any free port
    const char *const *worker_urls; // (n_workers) static workers, role "both"; borrowed for the call
    int n_workers;
    const char *const *prefill_urls;  // (n_prefill) static prefill workers
    int n_prefill;
    const char *const *decode_urls;   // (n_decode) static decode workers
    int n_decode;
    const char *auth_token;         // registration bearer token; NULL = registration is open
    pd_router_routing routing;
    double slo_ttft_ms;             // default SLOs for classes that set none; 0 = none
    double slo_tpot_ms;
    const char *qos_json;           // contents of --qos-config (NULL = built-in classes)
    int heartbeat_ms;               // default 200
    int n_poll_failures_down;       // polls failed in a row before a worker leaves rotation (3)
    int upstream_timeout_s;         // per upstream request (default 600)
    int max_attempts;               // tries per request, across workers (default 3)
    uint64_t seed;                  // random routing
    int max_connections;            // client connections at most; 0 = from RLIMIT_NOFILE (http.h)
    int keepalive_timeout_s;        // 0 = default (30)
    int header_timeout_s;           // 0 = default (60)
    size_t max_body_bytes;          // 0 = default (8 MiB)
    const char *control_url;        // cluster mode: "nats://HOST:PORT" (workers from NATS presence; auth_token
                                    // is the NATS token); NULL = HTTP polling only
    const char *control_nkey_seed;  // cluster mode: authenticate to NATS with this nkey seed file, not the token
    int control_expire_ms;          // cluster mode: a worker without presence this long leaves rotation (0: 4 heartbeats)
} pd_router_params;
pd_router_params pd_router_params_default(void);

// Starts listening and schedules the heartbeat on base (borrowed; must outlive the router).
// NULL with err: PD_ERR_IO (bind), PD_ERR_INVALID (bad params, bad URL, bad QoS config), NOMEM.
pd_router *pd_router_new(struct event_base *base, const pd_router_params *p, pd_err *err);
// Closes the listener, cancels upstream requests and frees everything. NULL is a no-op.
void pd_router_free(pd_router *r);
int pd_router_port(const pd_router *r);
// Workers currently in rotation.
int pd_router_n_healthy(const pd_router *r);
// Graceful shutdown (driven by `pdserve router` on SIGTERM/SIGINT), as a worker's (api.h):
// pd_router_drain: /health answers 503 {"status":"draining"}, new requests 503 + Retry-After,
// proxied requests continue; pd_router_is_drained: none left and their last bytes written;
// pd_router_end_all: the deadline passed: streams end with an SSE error event (no [DONE]), the
// upstream calls are cancelled (the workers see the disconnect and abort).
void pd_router_drain(pd_router *r, int retry_after_s);
bool pd_router_is_drained(pd_router *r);
void pd_router_end_all(pd_router *r, const char *msg);

#ifdef __cplusplus
}
#endif
