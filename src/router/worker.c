// worker.c — the worker registry and the heartbeat.
//
// Workers live in fixed slots (PD_ROUTER_MAX_WORKERS); a slot index is the worker's bit in the
// prefix index, so a removed worker's blocks are cleared before its slot is reused.
//
// Heartbeat: every heartbeat_ms the timer sends one GET <url>/internal/state?since=<seq_next> to
// each worker that has no poll in flight. A STATE reply refreshes the load report and applies the
// KV events to the prefix index (a changed instance id or "reset" clears the worker's entries
// first). Health:
//
//             N polls fail in a row, or a proxied request cannot connect
//   HEALTHY ─────────────────────────────────────────────────────────────► DOWN
//      ▲                                                                     │
//      └──────────────── one poll gets any HTTP reply ◄──────────────────────┘
//
// A worker that answers but has no /internal/state yet (404) counts as alive, without load.
#include <event2/event.h>
#include <stdio.h>
#include <string.h>

#include "base/buf.h"
#include "router/router_impl.h"

int rt_n_healthy(const pd_router *r) {
    int n = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) n += r->workers[i].is_used && r->workers[i].is_healthy;
    return n;
}

int rt_n_decode_healthy(const pd_router *r) {
    int n = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        n += w->is_used && w->is_healthy && w->role != PD_WIRE_ROLE_PREFILL;
    }
    return n;
}

int64_t rt_worker_capacity(const pd_router *r, const rt_worker *w) {
    return pd_router_worker_capacity(w->has_state ? w->load.n_max_seqs : 0, w->has_state ? w->load.n_max_waiting : 0,
                                     r->qos.capacity_per_worker);
}

int64_t rt_pool_capacity(const pd_router *r) {
    int64_t sum = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        if (!w->is_used || !w->is_healthy || w->role == PD_WIRE_ROLE_PREFILL) continue;
        int64_t c = rt_worker_capacity(r, w);
        if (c <= 0) return 0;
        sum += c;
    }
    return sum;
}

static void worker_metric(pd_router *r, rt_worker *w) {
    char labels[PD_WIRE_URL_MAX + 16];
    snprintf(labels, sizeof labels, "worker=\"%s\"", w->url);
    w->m_routed = pd_metrics_find(r->metrics, "pdserve_router_routed_total", labels);
    if (!w->m_routed)
        w->m_routed = pd_metrics_counter(r->metrics, "pdserve_router_routed_total",
                                         "Requests routed to each worker", labels, NULL);
}

int rt_worker_add(pd_router *r, const char *url, pd_wire_role role, const char *model,
                  int32_t block_size, bool is_static, pd_err *err) {
    char u[PD_WIRE_URL_MAX];
    size_t n = strlen(url);
    if (n >= sizeof u || strncmp(url, "http://", 7) != 0 || n <= 7) {
        pd_err_set(err, PD_ERR_INVALID, "router: worker URL must be http://host:port: %s", url);
        return -1;
    }
    memcpy(u, url, n + 1);
    while (n > 7 && u[n - 1] == '/') u[--n] = 0;
    int free_slot = -1;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (w->is_used && !strcmp(w->url, u)) {  // re-registration refreshes what it says
            w->role = role;
            if (model && *model) snprintf(w->model, sizeof w->model, "%s", model);
            if (block_size > 0) w->block_size = block_size;
            return i;
        }
        if (!w->is_used && free_slot < 0) free_slot = i;
    }
    if (free_slot < 0) {
        pd_err_set(err, PD_ERR_INVALID, "router: more than %d workers", PD_ROUTER_MAX_WORKERS);
        return -1;
    }
    rt_worker *w = &r->workers[free_slot];
    memset(w, 0, sizeof *w);
    w->rt = r;
    w->idx = free_slot;
    w->is_used = true;
    w->is_static = is_static;
    // NOTE: a new worker is in rotation at once (the first poll follows within a heartbeat); if it
    // is dead, the first proxied request fails over and takes it out.
    w->is_healthy = true;
    snprintf(w->url, sizeof w->url, "%s", u);
    w->role = role;
    snprintf(w->model, sizeof w->model, "%s", model ? model : "");
    w->block_size = block_size > 0 ? block_size : 16;
    w->load = pd_wire_load_default();
    worker_metric(r, w);
    PD_LOG_I("router: worker %s (%s) added", w->url, pd_wire_role_str(role));
    return free_slot;
}

static void worker_clear(pd_router *r, rt_worker *w) {
    if (w->poll_call) pd_http_client_call_cancel(w->poll_call);
    pd_router_prefix_clear_worker(r->prefix, w->idx);
    pd_free(w->poll_buf);
    pd_metric *m = w->m_routed;
    memset(w, 0, sizeof *w);
    w->m_routed = m;
}

pd_status rt_worker_remove(pd_router *r, const char *url) {
    char u[PD_WIRE_URL_MAX];
    snprintf(u, sizeof u, "%s", url);
    size_t n = strlen(u);
    while (n > 7 && u[n - 1] == '/') u[--n] = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (w->is_used && !strcmp(w->url, u)) {
            PD_LOG_I("router: worker %s removed", w->url);
            // Jobs still running there keep their index; their accounting is reset with the slot
            // and guarded against underflow in proxy.c.
            worker_clear(r, w);
            return PD_OK;
        }
    }
    return PD_ERR_NOTFOUND;
}

void rt_worker_set_healthy(pd_router *r, rt_worker *w, bool ok) {
    if (w->is_healthy != ok)
        PD_LOG_I("router: worker %s is %s", w->url, ok ? "back in rotation" : "out of rotation");
    w->is_healthy = ok;
    pd_metric_set(r->m_workers_healthy, rt_n_healthy(r));
}

void rt_worker_note_failure(pd_router *r, int w_idx, bool is_hard) {
    rt_worker *w = &r->workers[w_idx];
    if (!w->is_used) return;
    w->n_failed++;
    if (is_hard) rt_worker_set_healthy(r, w, false);
}

static void apply_events(pd_router *r, rt_worker *w, const pd_wire_state *s) {
    for (int32_t i = 0; i < s->n_events; i++) {
        const pd_wire_kv_event *e = &s->events[i];
        bool tier = e->tier > PD_WIRE_TIER_DEVICE && e->tier < PD_WIRE_N_TIERS;
        if (e->tier >= PD_WIRE_N_TIERS && e->type != PD_WIRE_KV_ALL_CLEARED) continue;  // a tier we do not know
        switch (e->type) {
            case PD_WIRE_KV_STORED:
                if (tier) (void)pd_router_prefix_add_tier(r->prefix, e->hash, w->idx, (int)e->tier);
                else (void)pd_router_prefix_add(r->prefix, e->hash, w->idx);
                break;
            case PD_WIRE_KV_REMOVED:
                if (tier) pd_router_prefix_remove_tier(r->prefix, e->hash, w->idx, (int)e->tier);
                else pd_router_prefix_remove(r->prefix, e->hash, w->idx);
                break;
            default: pd_router_prefix_clear_worker(r->prefix, w->idx); break;
        }
    }
    pd_metric_inc(r->m_kv_events, s->n_events);
}

// One STATE (a poll's reply, a NATS presence or a resync reply). is_presence: the events listed
// continue from `since` (the worker's previous presence): if that is not where we are, nothing of
// the list is applied and the caller asks for a resync (returns true). The load is applied anyway.
bool rt_worker_apply_state(pd_router *r, rt_worker *w, const char *buf, size_t len, bool is_presence, uint64_t since) {
    pd_wire_state s;
    pd_err err = {0};
    if (pd_wire_state_decode(buf, len, &s, &err) != PD_OK) {
        PD_LOG_W("router: %s state: %s", w->url, err.msg);
        pd_wire_state_fini(&s);
        return false;
    }
    bool gap = false;
    bool same = w->has_state && s.instance == w->instance;
    if (is_presence && !s.is_reset && (!same || since != w->seq_next)) {
        gap = true;  // missed a presence (or a new worker / router): events from w->seq_next via resync
    } else {
        if (!same || s.is_reset) {
            pd_router_prefix_clear_worker(r->prefix, w->idx);
            if (w->has_state && s.instance != w->instance) PD_LOG_I("router: worker %s restarted (new instance)", w->url);
        }
        apply_events(r, w, &s);
        w->seq_next = s.seq_next;
    }
    if (same) rt_history_disagg(r, &s.load, &w->load);
    if (!same && gap) w->seq_next = 0;  // a new instance: everything it still holds
    w->has_state = true;
    w->instance = s.instance;
    w->prev_load = w->load;
    w->load = s.load;
    // Load that is not ours (other routers, direct clients): what the worker reports beyond the
    // requests we had in flight while it answered (the larger count, to stay lenient).
    int ours = PD_MAX(w->inflight_at_poll, w->n_inflight);
    w->n_foreign = PD_MAX(0, s.load.n_running + s.load.n_waiting - ours);
    if (s.block_size > 0) w->block_size = s.block_size;
    if (s.model[0]) snprintf(w->model, sizeof w->model, "%s", s.model);
    pd_wire_state_fini(&s);
    // The decode worker's link-aware model (wire/link.h): the router predicts its prefill time with it.
    json_t *o = json_loadb(buf, len, 0, NULL);
    json_t *dm = o ? json_object_get(o, "disagg_model") : NULL;
    w->has_model = dm && pd_disagg_model_from_json(dm, &w->model_dm) == PD_OK;
    json_decref(o);
    return gap;
}

static void poll_ok(pd_router *r, rt_worker *w, int http_status) {
    w->n_poll_failures = 0;
    w->t_last_ok_us = pd_time_us();
    rt_worker_set_healthy(r, w, true);
    if (http_status != 200) return;  // alive, but no state endpoint (yet)
    rt_worker_apply_state(r, w, w->poll_buf ? w->poll_buf : "", w->poll_len, false, 0);
}

static void on_poll_body(pd_http_client_call *call, const char *data, size_t len, void *ud) {
    rt_worker *w = ud;
    if (len >= SIZE_MAX - w->poll_len || PD_ARRAY_RESERVE(w->poll_buf, w->poll_cap, w->poll_len + len + 1) != PD_OK)
        return;  // the decode will fail and be logged
    memcpy(w->poll_buf + w->poll_len, data, len);
    w->poll_len += len;
    w->poll_buf[w->poll_len] = 0;
}

static void on_poll_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg,
                         void *ud) {
    rt_worker *w = ud;
    pd_router *r = w->rt;
    w->is_polling = false;
    w->poll_call = NULL;
    if (st == PD_OK && http_status > 0) {
        poll_ok(r, w, http_status);
    } else {
        w->n_poll_failures++;
        pd_metric_inc(r->m_poll_failures, 1);
        PD_LOG_D("router: poll %s failed (%d in a row): %s", w->url, w->n_poll_failures, msg);
        if (w->n_poll_failures >= r->n_poll_failures_down) rt_worker_set_healthy(r, w, false);
    }
}

static void poll_worker(pd_router *r, rt_worker *w) {
    char url[PD_WIRE_URL_MAX + 64];
    snprintf(url, sizeof url, "%s/internal/state?since=%llu", w->url, (unsigned long long)w->seq_next);
    pd_http_client_request rq = {.method = "GET", .url = url};
    pd_http_client_callbacks cb = {.on_body = on_poll_body, .on_done = on_poll_done};
    w->poll_len = 0;
    if (w->poll_buf) w->poll_buf[0] = 0;
    w->inflight_at_poll = w->n_inflight;
    pd_err err = {0};
    w->poll_call = pd_http_client_send(r->poll_client, &rq, &cb, w, &err);
    if (!w->poll_call) {
        PD_LOG_W("router: cannot poll %s: %s", w->url, err.msg);
        return;
    }
    w->is_polling = true;
}

static void on_heartbeat(evutil_socket_t fd, short what, void *arg) {
    pd_router *r = arg;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (w->is_used && !w->is_polling && !w->is_nats) poll_worker(r, w);
    }
    int queued = 0;
    for (int i = 0; i < r->qos.n_classes; i++) queued += r->inflight_by_class[i];
    pd_metric_set(r->m_queue, queued);
    int running = 0, waiting = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        if (!w->is_used || !w->is_healthy || !w->has_state) continue;
        running += w->load.n_running;
        waiting += w->load.n_waiting;
    }
    rt_history_queue(r, queued, running, waiting);
}

pd_status rt_heartbeat_start(pd_router *r) {
    r->heartbeat = event_new(r->base, -1, EV_PERSIST, on_heartbeat, r);
    if (!r->heartbeat) return PD_ERR_NOMEM;
    struct timeval tv = {r->heartbeat_ms / 1000, (r->heartbeat_ms % 1000) * 1000};
    if (event_add(r->heartbeat, &tv)) return PD_ERR_IO;
    on_heartbeat(-1, 0, r);  // first poll now, not a heartbeat later
    return PD_OK;
}

void rt_heartbeat_stop(pd_router *r) {
    if (r->heartbeat) event_free(r->heartbeat);
    r->heartbeat = NULL;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (w->poll_call) pd_http_client_call_cancel(w->poll_call);
        w->poll_call = NULL;
        w->is_polling = false;
        pd_free(w->poll_buf);
        w->poll_buf = NULL;
    }
}
