// server.c — the router object: construction, the route table and the small endpoints
// (registration, /health, /v1/models, /metrics). The proxy lives in proxy.c, the registry and
// heartbeat in worker.c, the status page in status.c.
//
// Registration is authenticated with one shared bearer token (--auth-token-file): the header
// `Authorization: Bearer <token>` must match exactly (compared in constant time), else 401.
// Without a token file registration and deregistration are refused (403): an open endpoint let
// any local process add a fake worker or remove a real one. `pdserve run` always sets a token.
// The token crosses the wire in the clear: keep the router's registration port on loopback or a
// private network (the KV ports use an HMAC challenge-response instead, xfer/auth.h).
#include <event2/event.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "router/router_impl.h"

static const char *const ROUTING_NAMES[] = {"kv", "load", "round-robin", "random"};

const char *pd_router_routing_str(pd_router_routing r) {
    return (unsigned)r < PD_ARRAY_LEN(ROUTING_NAMES) ? ROUTING_NAMES[r] : "kv";
}

pd_status pd_router_routing_parse(const char *s, pd_router_routing *out) {
    for (size_t i = 0; s && i < PD_ARRAY_LEN(ROUTING_NAMES); i++)
        if (!strcmp(s, ROUTING_NAMES[i])) {
            *out = (pd_router_routing)i;
            return PD_OK;
        }
    return PD_ERR_INVALID;
}

pd_router_params pd_router_params_default(void) {
    pd_router_params p;
    memset(&p, 0, sizeof p);
    p.host = "127.0.0.1";
    p.routing = PD_ROUTER_ROUTING_KV;
    p.heartbeat_ms = 200;
    p.n_poll_failures_down = 3;
    p.upstream_timeout_s = 600;
    p.max_attempts = 3;
    p.seed = 0x5eed;
    return p;
}

int pd_router_port(const pd_router *r) { return pd_http_server_port(r->http); }
int pd_router_n_healthy(const pd_router *r) { return rt_n_healthy(r); }

void pd_router_drain(pd_router *r, int retry_after_s) { pd_http_server_drain(r->http, retry_after_s); }
bool pd_router_is_drained(pd_router *r) {
    return !r->jobs && pd_http_server_n_active(r->http) == 0 && pd_http_server_n_unflushed(r->http) == 0;
}
// The close callbacks (proxy.c on_client_close) free the jobs and cancel their upstream calls.
void pd_router_end_all(pd_router *r, const char *msg) { pd_http_server_end_all(r->http, msg); }

// ---- handlers ----------------------------------------------------------------------------------------
static bool token_ok(const pd_router *r, pd_http_req *req) {
    if (!r->auth_token) return false;
    const char *a = pd_http_req_header(req, "Authorization");
    if (!a || strncasecmp(a, "Bearer ", 7)) return false;
    a += 7;
    size_t n = strlen(r->auth_token), m = strlen(a);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)r->auth_token[i] ^ (unsigned char)(i < m ? a[i] : 0);
    return diff == 0;
}

// The registration endpoints' gate: replies 401 and returns false without the right token.
static bool require_token(const pd_router *r, pd_http_req *req) {
    if (token_ok(r, req)) return true;
    if (!r->auth_token) {
        pd_http_reply_error(req, 403, "permission_error", "worker registration is disabled: start the router with --auth-token-file",
                            NULL, "registration_disabled");
        return false;
    }
    pd_http_reply_error(req, 401, "authentication_error", "invalid or missing registration token", NULL, "invalid_token");
    return false;
}

static void h_register(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    if (!require_token(r, req)) return;
    size_t len;
    const char *body = pd_http_req_body(req, &len);
    pd_wire_register m;
    pd_err err = {0};
    if (pd_wire_register_decode(body, len, &m, &err) != PD_OK)
        return pd_http_reply_error(req, 400, "invalid_request_error", err.msg, NULL, NULL);
    int slot = rt_worker_add(r, m.url, m.role, m.model, m.block_size, false, &err);
    if (slot < 0) return pd_http_reply_error(req, 503, "server_error", err.msg, NULL, NULL);
    json_t *o = json_pack("{s:b, s:s, s:i}", "ok", 1, "url", r->workers[slot].url, "heartbeat_ms", r->heartbeat_ms);
    pd_http_reply_json(req, 200, o);
    json_decref(o);
}

static void h_deregister(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    if (!require_token(r, req)) return;
    size_t len;
    const char *body = pd_http_req_body(req, &len);
    char url[PD_WIRE_URL_MAX];
    pd_err err = {0};
    if (pd_wire_deregister_decode(body, len, url, &err) != PD_OK)
        return pd_http_reply_error(req, 400, "invalid_request_error", err.msg, NULL, NULL);
    if (rt_worker_remove(r, url) != PD_OK)
        return pd_http_reply_error(req, 404, "invalid_request_error", "unknown worker", NULL, NULL);
    json_t *o = json_pack("{s:b}", "ok", 1);
    pd_http_reply_json(req, 200, o);
    json_decref(o);
}

// 200 "ok" while at least one decode-capable worker (role both or decode) is in rotation: that is
// what requests need. A pool of prefill workers alone serves nothing: 503.
static void h_health(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    int n = rt_n_healthy(r), nd = rt_n_decode_healthy(r);
    bool draining = pd_http_server_is_draining(r->http);
    json_t *o = json_pack("{s:s, s:i, s:i, s:i}", "status",
                          draining ? "draining" : nd > 0 ? "ok" : "no healthy decode worker", "workers_healthy", n,
                          "decode_workers_healthy", nd, "prefill_workers_healthy", n - nd);
    if (nd == 0 && !draining) pd_http_reply_header(req, "Retry-After", "1");
    pd_http_reply_json(req, nd > 0 && !draining ? 200 : 503, o);
    json_decref(o);
}

static void h_models(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    json_t *data = json_array();
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        if (!w->is_used || !w->model[0]) continue;
        bool seen = false;
        size_t k;
        json_t *m;
        json_array_foreach(data, k, m) seen |= !strcmp(json_string_value(json_object_get(m, "id")), w->model);
        if (!seen)
            json_array_append_new(data, json_pack("{s:s, s:s, s:i, s:s}", "id", w->model, "object", "model",
                                                  "created", 0, "owned_by", "pdserve"));
    }
    json_t *o = json_pack("{s:s, s:o}", "object", "list", "data", data);
    pd_http_reply_json(req, 200, o);
    json_decref(o);
}

static void h_metrics(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    char *txt = NULL;
    size_t len = 0;
    rt_nats_info ni;
    rt_nats_info_get(r, &ni);
    if (ni.is_on) {  // cluster mode: the NATS connection (gauges made on first use)
        static const char *const names[] = {"pdserve_router_nats_connected", "pdserve_router_nats_disconnects",
                                            "pdserve_router_nats_reconnects", "pdserve_router_nats_presences",
                                            "pdserve_router_nats_resyncs", "pdserve_router_nats_expired_workers",
                                            "pdserve_router_nats_bad_mac", "pdserve_router_nats_inbox_full",
                                            "pdserve_router_nats_workers_verified"};
        double v[] = {ni.is_connected, (double)ni.disconnects, (double)ni.reconnects, (double)ni.presences,
                      (double)ni.resyncs, (double)ni.expired, (double)ni.bad_mac, (double)ni.inbox_full,
                      (double)ni.verified};
        for (int i = 0; i < 9; i++) {
            pd_metric *g = pd_metrics_find(r->metrics, names[i], NULL);
            if (!g) g = pd_metrics_gauge(r->metrics, names[i], "NATS control plane (cluster mode); counts since start", NULL, NULL);
            if (g) pd_metric_set(g, v[i]);
        }
        for (int i = 0; i < RT_NATS_N_REJECTS; i++) {
            char l[64];
            snprintf(l, sizeof l, "reason=\"%s\"", rt_nats_reject_names[i]);
            pd_metric *g = pd_metrics_find(r->metrics, "pdserve_router_nats_rejected_total", l);
            if (!g)
                g = pd_metrics_gauge(r->metrics, "pdserve_router_nats_rejected_total",
                                     "NATS messages refused by the router, by reason (cluster mode; since start)", l, NULL);
            if (g) pd_metric_set(g, (double)ni.rejected[i]);
        }
    }
    if (pd_metrics_render(r->metrics, &txt, &len) != PD_OK)
        return pd_http_reply_error(req, 500, "server_error", "out of memory", NULL, NULL);
    pd_http_reply(req, 200, "text/plain; version=0.0.4", txt, len);
    pd_free(txt);
}

// ---- construction ------------------------------------------------------------------------------------
static pd_status make_metrics(pd_router *r, pd_err *err) {
    pd_metrics *m = r->metrics;
    for (int c = 0; c < r->qos.n_classes; c++) {
        char l[64];
        snprintf(l, sizeof l, "class=\"%s\"", r->qos.classes[c].name);
        rt_class_metrics *cm = &r->cm[c];
        cm->ttft = pd_metrics_histogram(m, "pdserve_router_time_to_first_token_seconds", "TTFT seen by clients, per class", l,
                                        pd_metrics_latency_buckets, pd_metrics_n_latency_buckets, err);
        cm->itl = pd_metrics_histogram(m, "pdserve_router_inter_token_latency_seconds", "Time between streamed chunks, per class", l,
                                       pd_metrics_itl_buckets, pd_metrics_n_itl_buckets, err);
        cm->e2e = pd_metrics_histogram(m, "pdserve_router_e2e_request_latency_seconds", "End-to-end latency, per class", l,
                                       pd_metrics_latency_buckets, pd_metrics_n_latency_buckets, err);
        cm->requests = pd_metrics_counter(m, "pdserve_router_requests_total", "Requests received, per class", l, err);
        cm->inflight = pd_metrics_gauge(m, "pdserve_router_requests_inflight", "Requests in flight, per class", l, err);
        char lr[96];
        snprintf(lr, sizeof lr, "class=\"%s\",reason=\"slo\"", r->qos.classes[c].name);
        cm->rejected_slo = pd_metrics_counter(m, "pdserve_router_rejected_total", "Requests rejected, per class and reason", lr, err);
        snprintf(lr, sizeof lr, "class=\"%s\",reason=\"capacity\"", r->qos.classes[c].name);
        cm->rejected_capacity = pd_metrics_counter(m, "pdserve_router_rejected_total", "Requests rejected, per class and reason", lr, err);
        snprintf(lr, sizeof lr, "class=\"%s\",reason=\"rate_limit\"", r->qos.classes[c].name);
        cm->rejected_rate = pd_metrics_counter(m, "pdserve_router_rejected_total", "Requests rejected, per class and reason", lr, err);
        if (!cm->ttft || !cm->itl || !cm->e2e || !cm->requests || !cm->inflight || !cm->rejected_slo ||
            !cm->rejected_capacity || !cm->rejected_rate)
            return PD_ERR_NOMEM;
    }
    for (int i = 0; i < 4; i++) {
        char l[48];
        snprintf(l, sizeof l, "policy=\"%s\"", ROUTING_NAMES[i]);
        r->m_decisions[i] = pd_metrics_counter(m, "pdserve_router_routing_decisions_total", "Routing decisions, per policy", l, err);
        if (!r->m_decisions[i]) return PD_ERR_NOMEM;
    }
    r->m_retries = pd_metrics_counter(m, "pdserve_router_retries_total", "Requests re-sent before their first byte", NULL, err);
    r->m_failovers = pd_metrics_counter(m, "pdserve_router_failovers_total", "Streams continued on another worker", NULL, err);
    r->m_prefix_query = pd_metrics_counter(m, "pdserve_router_prefix_query_tokens_total", "Prompt tokens routed (kv routing)", NULL, err);
    r->m_prefix_hit = pd_metrics_counter(m, "pdserve_router_prefix_hit_tokens_total", "Prompt tokens predicted cached where routed", NULL, err);
    r->m_workers_healthy = pd_metrics_gauge(m, "pdserve_router_workers_healthy", "Workers in rotation", NULL, err);
    r->m_poll_failures = pd_metrics_counter(m, "pdserve_router_poll_failures_total", "Failed heartbeats", NULL, err);
    r->m_queue = pd_metrics_gauge(m, "pdserve_router_queue_length", "Requests in flight through the router", NULL, err);
    r->m_tokenize_failures = pd_metrics_counter(m, "pdserve_router_tokenize_failures_total", "Failed tokenize calls", NULL, err);
    r->m_kv_events = pd_metrics_counter(m, "pdserve_router_kv_events_total", "KV events applied to the prefix index", NULL, err);
    for (int i = 0; i < RT_N_TTFT_PARTS; i++) {
        char l[48];
        snprintf(l, sizeof l, "part=\"%s\"", i == 0 ? "router" : pd_wire_ttft_part_names[i - 1]);
        r->m_ttft_part[i] = pd_metrics_histogram(m, "pdserve_router_ttft_part_seconds",
                                                 "Time to first token by part: router (arrival to upstream request), then "
                                                 "the worker's queue, prefill, transfer and first decode",
                                                 l, pd_metrics_latency_buckets, pd_metrics_n_latency_buckets, err);
        if (!r->m_ttft_part[i]) return PD_ERR_NOMEM;
    }
    if (!r->m_retries || !r->m_failovers || !r->m_prefix_query || !r->m_prefix_hit || !r->m_workers_healthy ||
        !r->m_poll_failures || !r->m_queue || !r->m_tokenize_failures || !r->m_kv_events)
        return PD_ERR_NOMEM;
    return PD_OK;
}

static pd_status add_routes(pd_router *r) {
    pd_http_server *s = r->http;
    if (pd_http_server_route(s, "POST", "/v1/completions", rt_handle_completions, r) ||
        pd_http_server_route(s, "POST", "/v1/chat/completions", rt_handle_chat, r) ||
        pd_http_server_route(s, "GET", "/v1/models", h_models, r) ||
        pd_http_server_route(s, "GET", "/health", h_health, r) ||
        pd_http_server_route(s, "GET", "/metrics", h_metrics, r) ||
        pd_http_server_route(s, "POST", "/internal/register", h_register, r) ||
        pd_http_server_route(s, "POST", "/internal/deregister", h_deregister, r) ||
        pd_http_server_route(s, "GET", "/status", rt_handle_status_html, r) ||
        pd_http_server_route(s, "GET", "/status.json", rt_handle_status_json, r))
        return PD_ERR_NOMEM;
    return PD_OK;
}

static pd_status add_static(pd_router *r, const char *const *urls, int n, pd_wire_role role, pd_err *err) {
    for (int i = 0; i < n; i++)
        if (rt_worker_add(r, urls[i], role, "", 0, true, err) < 0) return PD_ERR_INVALID;
    return PD_OK;
}

pd_router *pd_router_new(struct event_base *base, const pd_router_params *p, pd_err *err) {
    if (p->heartbeat_ms <= 0 || p->max_attempts <= 0 || p->n_poll_failures_down <= 0) {
        pd_err_set(err, PD_ERR_INVALID, "router: heartbeat, attempts and failure count must be > 0");
        return NULL;
    }
    pd_router *r = pd_calloc(1, sizeof *r);
    if (!r) {
        pd_err_set(err, PD_ERR_NOMEM, "router: out of memory");
        return NULL;
    }
    r->base = base;
    r->routing = p->routing;
    r->cost = pd_router_cost_params_default();
    r->heartbeat_ms = p->heartbeat_ms;
    r->n_poll_failures_down = p->n_poll_failures_down;
    r->max_attempts = p->max_attempts;
    r->upstream_timeout_s = p->upstream_timeout_s;
    r->default_prefill_tps = 20000;
    r->default_step_ms = 5;
    pd_rng_seed(&r->rng, p->seed);
    if (p->qos_json) {
        if (pd_router_qos_parse(&r->qos, p->qos_json, p->slo_ttft_ms, p->slo_tpot_ms, err) != PD_OK) goto fail;
    } else {
        pd_router_qos_default(&r->qos, p->slo_ttft_ms, p->slo_tpot_ms);
    }
    if (p->auth_token && !(r->auth_token = pd_strdup(p->auth_token))) goto nomem;
    if (!(r->metrics = pd_metrics_new()) || !(r->prefix = pd_router_prefix_new(1 << 22))) goto nomem;
    if (make_metrics(r, err) != PD_OK) goto fail;
    pd_http_client_params cp = pd_http_client_params_default();
    cp.read_timeout_ms = p->upstream_timeout_s * 1000;
    if (!(r->client = pd_http_client_new(base, &cp, err))) goto fail;
    cp.read_timeout_ms = PD_MAX(1000, 5 * p->heartbeat_ms);
    cp.request_timeout_ms = PD_MAX(2000, 10 * p->heartbeat_ms);
    cp.max_connections = 2 * PD_ROUTER_MAX_WORKERS + 64;
    if (!(r->poll_client = pd_http_client_new(base, &cp, err))) goto fail;
    if (add_static(r, p->worker_urls, p->n_workers, PD_WIRE_ROLE_BOTH, err) ||
        add_static(r, p->prefill_urls, p->n_prefill, PD_WIRE_ROLE_PREFILL, err) ||
        add_static(r, p->decode_urls, p->n_decode, PD_WIRE_ROLE_DECODE, err))
        goto fail;
    pd_http_params hp = pd_http_params_default();
    hp.host = p->host ? p->host : "127.0.0.1";
    hp.port = p->port;
    if (p->max_connections > 0) hp.max_connections = p->max_connections;
    if (p->keepalive_timeout_s > 0) hp.keepalive_timeout_s = p->keepalive_timeout_s;
    if (p->header_timeout_s > 0) hp.header_timeout_s = p->header_timeout_s;
    if (p->max_body_bytes > 0) hp.max_body_bytes = p->max_body_bytes;
    if (!(r->http = pd_http_server_new(base, &hp, err))) goto fail;
    if (add_routes(r) != PD_OK) goto nomem;
    if (rt_heartbeat_start(r) != PD_OK) goto nomem;
    if (p->control_url) {
        if (!r->auth_token) {
            pd_err_set(err, PD_ERR_INVALID, "router: --control needs --auth-token-file (the NATS connection authenticates)");
            goto fail;
        }
        if (rt_nats_start(r, p->control_url, r->auth_token, p->control_nkey_seed, p->control_expire_ms, err) != PD_OK) goto fail;
    }
    pd_metric_set(r->m_workers_healthy, rt_n_healthy(r));
    if (!r->auth_token) PD_LOG_W("router: no --auth-token-file: worker registration is disabled");
    return r;
nomem:
    pd_err_set(err, PD_ERR_NOMEM, "router: out of memory");
fail:
    pd_router_free(r);
    return NULL;
}

void pd_router_free(pd_router *r) {
    if (!r) return;
    rt_nats_stop(r);
    rt_heartbeat_stop(r);
    pd_http_server_free(r->http);  // close callbacks free the jobs of connected clients
    rt_jobs_free_all(r);
    pd_http_client_free(r->client);
    pd_http_client_free(r->poll_client);
    pd_router_prefix_free(r->prefix);
    pd_metrics_free(r->metrics);
    pd_free(r->auth_token);
    pd_free(r);
}
