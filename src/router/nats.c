// nats.c — the router's side of the NATS control plane (control/control.h; docs/design.md,
// "Cluster mode"). Instead of polling each worker's GET /internal/state, the router subscribes to
// every worker's PRESENCE (pdserve.presence.>): a worker is admitted once its HTTP address confirms
// it (below), its load, KV events and link-aware model are applied on each presence, and it leaves
// rotation when its presences stop for expire_ms (its heartbeats stopped) or at once when it says
// it is leaving.
//
//   presence ─► events continue from our seq_next? ─yes─► apply (rt_worker_apply_state)
//                                                 └─no──► apply the load, request a resync:
//   PUBLISH pdserve.resync.<instance> "since=<seq_next>" reply-to pdserve.router.<id> ─► the
//   worker answers with its STATE since then (reset when its log no longer has it) ─► apply.
//
// What a presence must be (anything else is refused, counted by reason in /metrics
// pdserve_router_nats_rejected_total{reason} and /status.json, and logged at most once a second a
// reason): signed (control.c drops a message without a valid Pd-Mac before it gets here), on
// subject pdserve.presence.<role>.<16 hex digits>, a JSON object whose "role" and "instance" are
// the subject's, "url" http://HOST:PORT, "since" and "pseq" non-negative integers. Per instance:
//   * first presence: not trusted yet. The router GETs <url>/internal/state itself; only if that
//     address answers a STATE with the same instance and role is a slot given (and the worker put
//     in rotation). At most RT_NATS_MAX_PENDING checks run at once (more: refused, "pending_full");
//     an instance that failed is not checked again for a second. So a thousand fake workers, or
//     addresses that are not pdserve workers, never take a slot or get a request;
//   * later presences must name the same url and role ("spoofed" otherwise) and a pseq above the
//     last one applied ("replayed" otherwise: duplicates, replays, and a "leaving" recorded earlier).
// Resync answers are taken only for an instance with a resync outstanding ("unsolicited").
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

#define RT_NATS_MAX_PENDING 8
#define RT_NATS_N_RECENT 64
#define RT_NATS_RECHECK_US 1000000

enum { RJ_JSON, RJ_SUBJECT, RJ_FIELD, RJ_SPOOF, RJ_REPLAY, RJ_PENDING_FULL, RJ_VERIFY, RJ_UNSOLICITED, RJ_TABLE_FULL };
const char *const rt_nats_reject_names[RT_NATS_N_REJECTS] = {"bad_json",     "bad_subject", "bad_field",
                                                             "spoofed",      "replayed",    "pending_full",
                                                             "verify_failed", "unsolicited", "table_full"};

typedef struct rt_nats rt_nats;

// A worker's first presence, being checked over HTTP.
typedef struct rt_pending {
    rt_nats *n;
    bool is_used;
    uint64_t instance;
    pd_wire_role role;
    int64_t pseq;
    char url[PD_WIRE_URL_MAX];
    pd_http_client_call *call;
    char *buf;
    size_t len, cap;
} rt_pending;

struct rt_nats {
    pd_router *r;
    pd_ctl *ctl;
    struct event *ev_inbox, *ev_expire;
    char reply_subj[64];
    int expire_ms;
    bool is_down;
    int64_t n_presences, n_resyncs, n_expired, n_verified;
    int64_t n_rejected[RT_NATS_N_REJECTS];
    int64_t t_logged_us[RT_NATS_N_REJECTS], n_unlogged[RT_NATS_N_REJECTS];
    rt_pending pending[RT_NATS_MAX_PENDING];
    struct { uint64_t instance; int64_t t_us; } recent[RT_NATS_N_RECENT];  // failed checks
    int recent_next;
};

// Counts a refusal and logs it (at most once a second a reason, with how many went unlogged).
static void reject(rt_nats *n, int why, const char *subject, const char *detail) {
    n->n_rejected[why]++;
    int64_t now = pd_time_us();
    if (now - n->t_logged_us[why] < 1000000) {
        n->n_unlogged[why]++;
        return;
    }
    PD_LOG_W("router: NATS message on %.96s refused (%s): %s%s", subject, rt_nats_reject_names[why], detail,
             n->n_unlogged[why] ? " (and more of this reason in the last second, not logged)" : "");
    n->t_logged_us[why] = now;
    n->n_unlogged[why] = 0;
}

static rt_worker *find_instance(pd_router *r, uint64_t instance) {
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++)
        if (r->workers[i].is_used && r->workers[i].is_nats && r->workers[i].instance == instance) return &r->workers[i];
    return NULL;
}

// Exactly 16 hex digits (an instance id as workers write it).
static bool parse_instance(const char *s, size_t n, uint64_t *out) {
    if (!s || n != 16) return false;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return true;
}

// http://HOST:PORT[/]: HOST a DNS name / IPv4 address ([A-Za-z0-9.-], 1..253) or a bracketed IPv6
// address, PORT 1..65535, nothing else (no user info, path, query, spaces or control characters).
static bool url_ok(const char *u) {
    if (strncmp(u, "http://", 7)) return false;
    const char *h = u + 7, *p;
    if (*h == '[') {
        p = h + 1;
        while (*p && (strchr("0123456789abcdefABCDEF:.", *p))) p++;
        if (*p != ']' || p == h + 1) return false;
        p++;
    } else {
        p = h;
        while (*p && ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' || *p == '-'))
            p++;
        if (p == h || p - h > 253) return false;
    }
    if (*p++ != ':') return false;
    long port = 0;
    const char *d = p;
    while (*p >= '0' && *p <= '9' && p - d < 6) port = port * 10 + (*p++ - '0');
    if (p == d || port < 1 || port > 65535) return false;
    while (*p == '/') p++;
    return *p == 0;
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

static bool recently_failed(rt_nats *n, uint64_t instance) {
    int64_t now = pd_time_us();
    for (int i = 0; i < RT_NATS_N_RECENT; i++)
        if (n->recent[i].t_us && n->recent[i].instance == instance && now - n->recent[i].t_us < RT_NATS_RECHECK_US) return true;
    return false;
}

static void pending_end(rt_pending *p) {
    if (p->call) pd_http_client_call_cancel(p->call);
    pd_free(p->buf);
    rt_nats *n = p->n;
    memset(p, 0, sizeof *p);
    p->n = n;
}

static void on_verify_body(pd_http_client_call *call, const char *data, size_t len, void *ud) {
    (void)call;
    rt_pending *p = ud;
    if (p->len == SIZE_MAX) return;
    if (p->len + len > PD_CTL_MAX_MSG || PD_ARRAY_RESERVE(p->buf, p->cap, p->len + len + 1) != PD_OK) {
        p->len = SIZE_MAX;  // too large or OOM: fails below
        return;
    }
    memcpy(p->buf + p->len, data, len);
    p->len += len;
    p->buf[p->len] = 0;
}

// The worker's HTTP address answered (or not): admit it only if it is the instance that
// published the presence.
static void on_verify_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg, void *ud) {
    (void)call;
    rt_pending *p = ud;
    rt_nats *n = p->n;
    pd_router *r = n->r;
    p->call = NULL;  // (freed by the client after this callback)
    char why[PD_WIRE_URL_MAX + 768] = "";
    pd_wire_state s;
    memset(&s, 0, sizeof s);
    pd_err err = {0};
    if (st != PD_OK || http_status != 200) {
        snprintf(why, sizeof why, "%s/internal/state: %s", p->url, st != PD_OK ? msg : "not HTTP 200");
    } else if (p->len == SIZE_MAX || !p->buf || pd_wire_state_decode(p->buf, p->len, &s, &err) != PD_OK) {
        snprintf(why, sizeof why, "%s/internal/state: not a STATE (%s)", p->url, err.msg[0] ? err.msg : "too large");
    } else if (s.instance != p->instance || s.role != p->role) {
        snprintf(why, sizeof why, "%s is instance %016llx (%s), not the %016llx (%s) the presence claims", p->url,
                 (unsigned long long)s.instance, pd_wire_role_str(s.role), (unsigned long long)p->instance,
                 pd_wire_role_str(p->role));
    }
    pd_wire_state_fini(&s);
    if (why[0]) {
        n->recent[n->recent_next].instance = p->instance;
        n->recent[n->recent_next].t_us = pd_time_us();
        n->recent_next = (n->recent_next + 1) % RT_NATS_N_RECENT;
        reject(n, RJ_VERIFY, PD_CTL_SUBJ_PRESENCE, why);
        pending_end(p);
        return;
    }
    // A restarted worker (same url, new instance) replaces its old slot; an HTTP-registered one
    // at the same url is taken over (rt_worker_add refreshes it).
    int idx = rt_worker_add(r, p->url, p->role, NULL, 0, false, &err);
    if (idx < 0) {
        reject(n, RJ_TABLE_FULL, PD_CTL_SUBJ_PRESENCE, err.msg);
        pending_end(p);
        return;
    }
    rt_worker *w = &r->workers[idx];
    if (w->is_nats && w->instance != p->instance) {
        PD_LOG_I("router: worker %s restarted (instance %016llx, was %016llx)", w->url, (unsigned long long)p->instance,
                 (unsigned long long)w->instance);
        w->pseq = 0;
    }
    w->is_nats = true;
    w->has_state = false;  // (apply_state: a new instance clears what the slot had in the prefix index)
    w->pseq = p->pseq;
    w->t_last_presence_us = w->t_last_ok_us = pd_time_us();
    w->n_poll_failures = 0;
    rt_worker_apply_state(r, w, p->buf, p->len, false, 0);
    w->instance = p->instance;
    n->n_verified++;
    PD_LOG_I("router: worker %s (%s, instance %016llx) found through NATS; its address confirmed it", w->url,
             pd_wire_role_str(p->role), (unsigned long long)p->instance);
    if (!w->is_healthy) rt_worker_set_healthy(r, w, true);
    pending_end(p);
}

static void start_verify(rt_nats *n, const char *subject, uint64_t instance, pd_wire_role role, int64_t pseq,
                         const char *url) {
    rt_pending *p = NULL;
    for (int i = 0; i < RT_NATS_MAX_PENDING; i++) {
        if (n->pending[i].is_used && n->pending[i].instance == instance) return;  // being checked
        if (!n->pending[i].is_used && !p) p = &n->pending[i];
    }
    if (recently_failed(n, instance)) {
        reject(n, RJ_VERIFY, subject, "its address did not confirm it a moment ago");
        return;
    }
    if (!p) {
        reject(n, RJ_PENDING_FULL, subject, "too many new workers being checked at once");
        return;
    }
    p->is_used = true;
    p->instance = instance;
    p->role = role;
    p->pseq = pseq;
    snprintf(p->url, sizeof p->url, "%s", url);
    size_t k = strlen(p->url);
    while (k > 7 && p->url[k - 1] == '/') p->url[--k] = 0;
    char get[PD_WIRE_URL_MAX + 32];
    snprintf(get, sizeof get, "%s/internal/state?since=0", p->url);
    pd_http_client_request rq = {.method = "GET", .url = get};
    pd_http_client_callbacks cb = {.on_body = on_verify_body, .on_done = on_verify_done};
    pd_err err = {0};
    p->call = pd_http_client_send(n->r->poll_client, &rq, &cb, p, &err);
    if (!p->call) {
        reject(n, RJ_VERIFY, subject, err.msg);
        pending_end(p);
    }
}

static void on_presence(pd_router *r, const pd_ctl_msg *m) {
    rt_nats *n = r->nats;
    // pdserve.presence.<role>.<instance>
    const char *sub = m->subject + strlen(PD_CTL_SUBJ_PRESENCE);
    const char *dot = *sub == '.' ? strchr(sub + 1, '.') : NULL;
    char role_subj[16] = "";
    pd_wire_role role;
    uint64_t instance = 0;
    if (!dot || dot - sub - 1 >= (long)sizeof role_subj || strncmp(m->subject, PD_CTL_SUBJ_PRESENCE ".", strlen(PD_CTL_SUBJ_PRESENCE) + 1))
        return reject(n, RJ_SUBJECT, m->subject, "not pdserve.presence.<role>.<instance>");
    memcpy(role_subj, sub + 1, (size_t)(dot - sub - 1));
    if (pd_wire_role_parse(role_subj, &role) || !parse_instance(dot + 1, strlen(dot + 1), &instance))
        return reject(n, RJ_SUBJECT, m->subject, "unknown role or an instance that is not 16 hex digits");
    json_t *o = json_loadb(m->data, (size_t)m->len, JSON_REJECT_DUPLICATES, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        return reject(n, RJ_JSON, m->subject, "not a JSON object");
    }
    const char *url = json_string_value(json_object_get(o, "url"));
    const char *role_s = json_string_value(json_object_get(o, "role"));
    const char *inst_s = json_string_value(json_object_get(o, "instance"));
    json_t *since_j = json_object_get(o, "since"), *pseq_j = json_object_get(o, "pseq"), *lv = json_object_get(o, "leaving");
    uint64_t inst_body = 0;
    const char *bad = !url || strlen(url) >= PD_WIRE_URL_MAX || !url_ok(url) ? "\"url\" is not http://HOST:PORT"
                      : !role_s || strcmp(role_s, role_subj)                 ? "\"role\" is not the subject's"
                      : !inst_s || !parse_instance(inst_s, strlen(inst_s), &inst_body) || inst_body != instance
                          ? "\"instance\" is not the subject's"
                      : !json_is_integer(since_j) || json_integer_value(since_j) < 0 ? "\"since\" is not a count"
                      : !json_is_integer(pseq_j) || json_integer_value(pseq_j) < 1   ? "\"pseq\" is not a positive count"
                      : lv && !json_is_boolean(lv)                                     ? "\"leaving\" is not a boolean"
                                                                                       : NULL;
    if (bad) {
        json_decref(o);
        return reject(n, RJ_FIELD, m->subject, bad);
    }
    uint64_t since = (uint64_t)json_integer_value(since_j);
    int64_t pseq = (int64_t)json_integer_value(pseq_j);
    bool leaving = json_is_true(lv);
    char u[PD_WIRE_URL_MAX];
    snprintf(u, sizeof u, "%s", url);
    json_decref(o);
    size_t k = strlen(u);
    while (k > 7 && u[k - 1] == '/') u[--k] = 0;
    rt_worker *w = find_instance(r, instance);
    if (!w) {
        if (!leaving) start_verify(n, m->subject, instance, role, pseq, u);
        return;
    }
    if (strcmp(w->url, u) || w->role != role) return reject(n, RJ_SPOOF, m->subject, "another url or role for a known instance");
    if (pseq <= w->pseq) return reject(n, RJ_REPLAY, m->subject, "a presence counter already seen");
    w->pseq = pseq;
    if (leaving) {
        PD_LOG_I("router: worker %s left (NATS)", w->url);
        rt_worker_remove(r, w->url);
        return;
    }
    w->t_last_presence_us = pd_time_us();
    w->n_poll_failures = 0;
    w->t_last_ok_us = w->t_last_presence_us;
    if (!w->is_healthy) rt_worker_set_healthy(r, w, true);
    n->n_presences++;
    if (rt_worker_apply_state(r, w, m->data, (size_t)m->len, true, since)) ask_resync(r, w);
}

static void on_resync_reply(pd_router *r, const pd_ctl_msg *m) {
    json_t *o = json_loadb(m->data, (size_t)m->len, 0, NULL);
    const char *inst = o ? json_string_value(json_object_get(o, "instance")) : NULL;
    uint64_t instance = 0;
    bool ok = inst && parse_instance(inst, strlen(inst), &instance);
    json_decref(o);
    rt_worker *w = ok ? find_instance(r, instance) : NULL;
    if (!w || !w->t_resync_us) return reject(r->nats, RJ_UNSOLICITED, m->subject, "no resync of that instance is outstanding");
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

pd_status rt_nats_start(pd_router *r, const char *url, const char *token, const char *nkey_seed_file, int expire_ms,
                        pd_err *err) {
    rt_nats *n = pd_calloc(1, sizeof *n);
    if (!n) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    r->nats = n;
    n->r = r;
    for (int i = 0; i < RT_NATS_MAX_PENDING; i++) n->pending[i].n = n;
    n->expire_ms = expire_ms > 0 ? expire_ms : 4 * r->heartbeat_ms;
    pd_ctl_params cp = {.url = url, .token = token, .nkey_seed_file = nkey_seed_file, .sign_key = token,
                        .name = "pdserve-router"};
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
    for (int i = 0; i < RT_NATS_MAX_PENDING; i++) pending_end(&n->pending[i]);
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
    out->bad_mac = st.bad_mac;
    out->inbox_full = st.inbox_full;
    out->presences = n->n_presences;
    out->resyncs = n->n_resyncs;
    out->expired = n->n_expired;
    out->verified = n->n_verified;
    memcpy(out->rejected, n->n_rejected, sizeof out->rejected);
}
