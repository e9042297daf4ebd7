// nats.c — the router's side of the NATS control plane (control/control.h; docs/design.md,
// "Cluster mode"). Instead of polling each worker's GET /internal/state, the router subscribes to
// every worker's PRESENCE (pdserve.presence.>): a worker is added on its first presence, its load,
// KV events and link-aware model are applied on each one, and it leaves rotation when its
// presences stop for expire_ms (its heartbeats stopped) or at once when it says it is leaving.
//
//   presence ─► events continue from our seq_next? ─yes─► apply (rt_worker_apply_state)
//                                                 └─no──► apply the load, request a resync:
//   PUBLISH pdserve.resync.<instance> "since=<seq_next>" reply-to pdserve.router.<id> ─► the
//   worker answers with its STATE since then (reset when its log no longer has it) ─► apply.
//
// NATS down: nothing expires (the last known state keeps routing: workers are reached over HTTP,
// which does not need NATS); libnats reconnects in the background; on "up" every NATS worker gets a
// fresh expiry window, and the next presences bring the state up to date (resync where needed).
#include <event2/event.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control/control.h"
#include "router/router_impl.h"

typedef struct rt_nats {
    pd_ctl *ctl;
    struct event *ev_inbox, *ev_expire;
    char reply_subj[64];
    int expire_ms;
    bool is_down;
    int64_t n_presences, n_resyncs, n_expired;
} rt_nats;

static rt_worker *find_instance(pd_router *r, uint64_t instance) {
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].is_used && r->workers[i].is_nats && r->workers[i].instance == instance) return &r->workers[i];
    return NULL;
}

static void ask_resync(pd_router *r, rt_worker *w) {
    int64_t now = pd_time_us();
    if (w->t_resync_us && now - w->t_resync_us < 1000000) return;  // one outstanding at a time (1 s)
    char subj[96], body[48];
    snprintf(subj, sizeof subj, "%s.%016llx", PD_CTL_SUBJ_RESYNC, (unsigned long long)w->instance);
    int n = snprintf(body, sizeof body, "since=%llu", (unsigned long long)w->seq_next);
    if (pd_ctl_publish(r->nats->ctl, subj, r->nats->reply_subj, body, n) == PD_OK) {
        w->t_resync_us = now;
        r->nats->n_resyncs++;
    }
}

static void on_presence(pd_router *r, const pd_ctl_msg *m) {
    json_t *o = json_loadb(m->data, (size_t)m->len, 0, NULL);
    const char *url = o ? json_string_value(json_object_get(o, "url")) : NULL;
    const char *role_s = o ? json_string_value(json_object_get(o, "role")) : NULL;
    json_t *since_j = o ? json_object_get(o, "since") : NULL;
    pd_wire_role role;
    if (!url || !role_s || pd_wire_role_parse(role_s, &role) || !json_is_integer(since_j)) {
        PD_LOG_W("router: malformed presence on %s: ignored", m->subject);
        json_decref(o);
        return;
    }
    uint64_t since = (uint64_t)json_integer_value(since_j);
    bool leaving = json_is_true(json_object_get(o, "leaving"));
    pd_err err = {0};
    if (leaving) {
        if (rt_worker_remove(r, url) == PD_OK) PD_LOG_I("router: worker %s left (NATS)", url);
        json_decref(o);
        return;
    }
    int idx = rt_worker_add(r, url, role, NULL, 0, false, &err);
    json_decref(o);
    if (idx < 0) {
        PD_LOG_W("router: presence of %s: %s", url, err.msg);
        return;
    }
    rt_worker *w = &r->workers[idx];
    if (!w->is_nats) {
        w->is_nats = true;
        PD_LOG_I("router: worker %s (%s) found through NATS", w->url, pd_wire_role_str(role));
    }
    w->t_last_presence_us = pd_time_us();
    w->n_poll_failures = 0;
    w->t_last_ok_us = w->t_last_presence_us;
    if (!w->is_healthy) rt_worker_set_healthy(r, w, true);
    r->nats->n_presences++;
    if (rt_worker_apply_state(r, w, m->data, (size_t)m->len, true, since)) ask_resync(r, w);
}

static void on_resync_reply(pd_router *r, const pd_ctl_msg *m) {
    json_t *o = json_loadb(m->data, (size_t)m->len, 0, NULL);
    const char *inst = o ? json_string_value(json_object_get(o, "instance")) : NULL;
    char *end = NULL;
    uint64_t instance = inst ? strtoull(inst, &end, 16) : 0;
    bool ok = inst && end && !*end;
    json_decref(o);
    rt_worker *w = ok ? find_instance(r, instance) : NULL;
    if (!w) return;  // gone meanwhile
    w->t_resync_us = 0;
    rt_worker_apply_state(r, w, m->data, (size_t)m->len, false, 0);
}

static void on_inbox(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    pd_router *r = arg;
    pd_ctl_msg *list = pd_ctl_inbox_take(r->nats->ctl);
    for (pd_ctl_msg *m = list; m; m = m->next) {
        if (!strcmp(m->subject, PD_CTL_SUBJ_CONN)) {
            bool up = !strcmp(m->data, "up");
            r->nats->is_down = !up;
            if (up) {  // a fresh window: presences resume within a heartbeat
                int64_t now = pd_time_us();
                for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++)
                    if (r->workers[i].is_used && r->workers[i].is_nats) r->workers[i].t_last_presence_us = now;
            }
        } else if (!strcmp(m->subject, r->nats->reply_subj)) {
            on_resync_reply(r, m);
        } else {
            on_presence(r, m);
        }
    }
    pd_ctl_msg_free(list);
}

static void on_expire(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    pd_router *r = arg;
    if (r->nats->is_down) return;  // keep routing on the last known state
    int64_t now = pd_time_us();
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (!w->is_used || !w->is_nats || !w->is_healthy) continue;
        if (now - w->t_last_presence_us > (int64_t)r->nats->expire_ms * 1000) {
            PD_LOG_W("router: worker %s: no presence for %d ms (heartbeats stopped): out of rotation", w->url,
                     r->nats->expire_ms);
            rt_worker_set_healthy(r, w, false);
            r->nats->n_expired++;
        }
    }
}

pd_status rt_nats_start(pd_router *r, const char *url, const char *token, int expire_ms, pd_err *err) {
    rt_nats *n = pd_calloc(1, sizeof *n);
    if (!n) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    r->nats = n;
    n->expire_ms = expire_ms > 0 ? expire_ms : 4 * r->heartbeat_ms;
    pd_ctl_params cp = {.url = url, .token = token, .name = "pdserve-router"};
    if (!(n->ctl = pd_ctl_connect(&cp, err))) return err ? err->status : PD_ERR_IO;
    snprintf(n->reply_subj, sizeof n->reply_subj, "pdserve.router.%016llx", (unsigned long long)pd_rng_next(&r->rng));
    pd_status st = pd_ctl_subscribe(n->ctl, PD_CTL_SUBJ_PRESENCE ".>", err);
    if (!st) st = pd_ctl_subscribe(n->ctl, n->reply_subj, err);
    if (st) return st;
    n->ev_inbox = event_new(r->base, pd_ctl_inbox_fd(n->ctl), EV_READ | EV_PERSIST, on_inbox, r);
    n->ev_expire = event_new(r->base, -1, EV_PERSIST, on_expire, r);
    struct timeval tv = {0, 100000};
    if (!n->ev_inbox || !n->ev_expire || event_add(n->ev_inbox, NULL) || event_add(n->ev_expire, &tv))
        return pd_err_set(err, PD_ERR_NOMEM, "router: cannot watch the NATS inbox");
    PD_LOG_I("router: cluster mode: workers from NATS presence on %s (expire after %d ms without one)", url, n->expire_ms);
    return PD_OK;
}

void rt_nats_stop(pd_router *r) {
    rt_nats *n = r->nats;
    if (!n) return;
    if (n->ev_inbox) event_free(n->ev_inbox);
    if (n->ev_expire) event_free(n->ev_expire);
    pd_ctl_free(n->ctl);
    pd_free(n);
    r->nats = NULL;
}

void rt_nats_info_get(pd_router *r, rt_nats_info *out) {
    memset(out, 0, sizeof *out);
    rt_nats *n = r->nats;
    if (!n) return;
    out->is_on = true;
    out->is_connected = n->ctl && pd_ctl_is_connected(n->ctl) && !n->is_down;
    pd_ctl_stats st = {0};
    if (n->ctl) pd_ctl_stats_get(n->ctl, &st);
    out->disconnects = st.disconnects;
    out->reconnects = st.reconnects;
    out->presences = n->n_presences;
    out->resyncs = n->n_resyncs;
    out->expired = n->n_expired;
}
