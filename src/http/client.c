// client.c — pd_http_client: async HTTP/1.1 requests over a bounded pool of evhttp connections,
// with streaming bodies and an incremental SSE reader. See client.h for the contract.
//
// Design:
//   * Every call goes through the FIFO `queue` and is put on a connection by `kick`, a deferred
//     event that runs on the next loop iteration. So no callback ever runs inside
//     pd_http_client_send, and a connection is never re-used from inside a libevent callback of
//     the request that just left it (libevent tolerates that, but the reasoning is simpler).
//   * libevent owns each evhttp_request from evhttp_make_request until it calls done_cb (or
//     error_cb for a cancel). call->req is non-NULL exactly in that window, and it is the only
//     handle we ever cancel.
//   * Cancelling from inside one of the call's own callbacks would free the evhttp_request under
//     libevent's feet in some paths (the header callback), so such a cancel only marks the call
//     and puts it on `reap`, which a deferred event finishes; callbacks of a marked call are
//     dropped in the meantime. Cancels from anywhere else happen at once.
//   * libevent's error path calls error_cb(error) and then done_cb(NULL); we remember the error
//     in the first and report it in the second. For a cancel it calls error_cb only.
//
// Not handled: TLS, proxies, redirects, request bodies streamed from the caller, 100-continue,
// pipelining (one request per connection at a time, as evhttp does).
#include "http/client.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

typedef struct conn {
    struct evhttp_connection *evcon;  // owned
    char *host;                       // owned
    int port;
    pd_http_client_call *call;        // the call on it, or NULL when idle
} conn;

struct pd_http_client {
    struct event_base *base;  // borrowed
    pd_http_client_params p;
    conn *conns;              // owned: p.max_connections slots; evcon == NULL = unused slot
    int n_conns;              // slots with an evcon
    pd_http_client_call *all;      // every live call (doubly linked through prev/next)
    pd_http_client_call *q_head;   // queued calls, FIFO through q_next
    pd_http_client_call *q_tail;
    pd_http_client_call *reap;     // cancelled inside their own callbacks, through q_next
    struct event *ev_kick;    // owned: dispatches the queue
    struct event *ev_reap;    // owned: finishes deferred cancels
    int n_active;
    bool is_freeing;
};

struct pd_http_client_call {
    pd_http_client *c;
    pd_http_client_callbacks cb;
    void *ud;
    pd_http_client_call *prev, *next;  // in c->all
    pd_http_client_call *q_next;       // in c->q_* or c->reap
    enum evhttp_cmd_type cmd;
    char *host;              // owned
    int port;
    char *target;            // owned: path?query
    char **headers;          // owned: name/value pairs, NULL-terminated
    char *body;              // owned (NULL if none)
    size_t body_len;
    char *content_type;      // owned
    conn *conn;              // while on a connection
    struct evhttp_request *req;  // while libevent owns it (see design)
    struct evhttp_request *done_req;  // during on_done after a response (for header lookups)
    struct event *ev_timeout;    // owned (NULL when request_timeout_ms is 0)
    pd_http_client_sse sse;
    int http_status;
    int cb_depth;            // > 0 while one of its user callbacks runs
    bool is_cancelled;       // by the user: on_done never runs
    bool is_ending;          // no more on_headers/on_body/on_sse; on the reap list or finishing
    pd_status end_status;    // for the reaper
    const char *end_msg;     // static string
    bool is_queued;
    bool has_ev_error;
    enum evhttp_request_error ev_error;
};

pd_http_client_params pd_http_client_params_default(void) {
    return (pd_http_client_params){
        .max_connections = 256,
        .read_timeout_ms = 120000,
        .request_timeout_ms = 0,
        .max_sse_event_bytes = 16u << 20,
    };
}

// ================================================================================================
// SSE reader
// ================================================================================================

void pd_http_client_sse_init(pd_http_client_sse *s, size_t max_bytes) {
    memset(s, 0, sizeof *s);
    s->max_bytes = max_bytes ? max_bytes : (16u << 20);
}

void pd_http_client_sse_fini(pd_http_client_sse *s) {
    pd_buf_free(&s->line);
    pd_buf_free(&s->data);
    memset(s, 0, sizeof *s);
}

// Appends n bytes to b; PD_ERR_PROTO past max.
static pd_status buf_append(pd_buf *b, const char *src, size_t n, size_t max) {
    if (n > max || b->len > max - n) return PD_ERR_PROTO;
    return pd_buf_append(b, src, n);
}

// One complete line (without its terminator) of the event stream.
static pd_status sse_line(pd_http_client_sse *s, pd_http_client_sse_fn fn, void *ud) {
    const char *line = s->line.p ? s->line.p : "";
    size_t n = s->line.len;
    if (n == 0) {  // blank line: dispatch
        if (s->has_data) {
            static char empty[1];
            fn(s->event, s->data.p ? s->data.p : empty, s->data.len, ud);
        }
        pd_buf_clear(&s->data);
        s->has_data = false;
        s->event[0] = 0;
        return PD_OK;
    }
    if (line[0] == ':') return PD_OK;  // comment
    const char *colon = memchr(line, ':', n);
    size_t name_len = colon ? (size_t)(colon - line) : n;
    const char *value = colon ? colon + 1 : line + n;
    size_t value_len = (size_t)(line + n - value);
    if (value_len && value[0] == ' ') value++, value_len--;
    if (name_len == 4 && !memcmp(line, "data", 4)) {
        pd_status st;
        if (s->has_data && (st = buf_append(&s->data, "\n", 1, s->max_bytes))) return st;
        s->has_data = true;
        return buf_append(&s->data, value, value_len, s->max_bytes);
    }
    if (name_len == 5 && !memcmp(line, "event", 5)) {
        size_t m = PD_MIN(value_len, sizeof s->event - 1);
        memcpy(s->event, value, m);
        s->event[m] = 0;
    }
    return PD_OK;  // id:, retry:, unknown fields
}

pd_status pd_http_client_sse_feed(pd_http_client_sse *s, const char *buf, size_t len,
                                  pd_http_client_sse_fn fn, void *ud) {
    size_t i = 0;
    while (i < len) {
        char ch = buf[i];
        if (ch == '\n' && s->last_was_cr) {  // the \n of a \r\n
            s->last_was_cr = false;
            i++;
            continue;
        }
        s->last_was_cr = false;
        if (ch == '\r' || ch == '\n') {
            s->last_was_cr = ch == '\r';
            pd_status st = sse_line(s, fn, ud);
            if (st) return st;
            pd_buf_clear(&s->line);
            i++;
            continue;
        }
        size_t j = i;
        while (j < len && buf[j] != '\r' && buf[j] != '\n') j++;
        pd_status st = buf_append(&s->line, buf + i, j - i, s->max_bytes);
        if (st) return st;
        i = j;
    }
    return PD_OK;
}

// ================================================================================================
// calls
// ================================================================================================

static void call_free(pd_http_client_call *call) {
    pd_http_client *c = call->c;
    if (call->prev) call->prev->next = call->next;
    else c->all = call->next;
    if (call->next) call->next->prev = call->prev;
    c->n_active--;
    if (call->ev_timeout) event_free(call->ev_timeout);
    pd_http_client_sse_fini(&call->sse);
    if (call->headers)
        for (char **h = call->headers; *h; h++) pd_free(*h);
    pd_free(call->headers);
    pd_free(call->host);
    pd_free(call->target);
    pd_free(call->body);
    pd_free(call->content_type);
    pd_free(call);
}

static void queue_remove(pd_http_client_call *call) {
    pd_http_client *c = call->c;
    pd_http_client_call **pp = &c->q_head, *prev = NULL;
    while (*pp && *pp != call) prev = *pp, pp = &(*pp)->q_next;
    if (!*pp) return;
    *pp = call->q_next;
    if (c->q_tail == call) c->q_tail = prev;
    call->q_next = NULL;
    call->is_queued = false;
}

// Detaches the call from its connection (if any): the slot becomes idle and the queue is kicked.
static void call_release_conn(pd_http_client_call *call) {
    if (!call->conn) return;
    call->conn->call = NULL;
    call->conn = NULL;
    if (call->c->q_head && !call->c->is_freeing) event_active(call->c->ev_kick, EV_TIMEOUT, 1);
}

// Takes the request away from libevent (closing the connection) if it still has it.
static void call_abort_req(pd_http_client_call *call) {
    if (call->req) {
        struct evhttp_request *req = call->req;
        call->req = NULL;
        evhttp_cancel_request(req);  // runs error_cb(CANCEL), which sees req == NULL and returns
    }
    if (call->is_queued) queue_remove(call);
    call_release_conn(call);
}

// Ends the call: on_done (unless the user cancelled it), then frees it.
static void call_finish(pd_http_client_call *call, pd_status st, const char *msg) {
    call_abort_req(call);
    if (!call->is_cancelled) {
        call->is_ending = true;  // no callback after on_done
        call->cb_depth++;
        call->cb.on_done(call, st, call->http_status, msg ? msg : "", call->ud);
        call->cb_depth--;
    }
    call_free(call);
}

// Ends the call on the next loop iteration (we are inside libevent or the call's own callback).
static void call_end_deferred(pd_http_client_call *call, pd_status st, const char *msg) {
    if (call->is_ending) return;
    call->is_ending = true;
    call->end_status = st;
    call->end_msg = msg;
    if (call->is_queued) queue_remove(call);
    call->q_next = call->c->reap;
    call->c->reap = call;
    event_active(call->c->ev_reap, EV_TIMEOUT, 1);
}

void pd_http_client_call_cancel(pd_http_client_call *call) {
    if (!call || call->is_cancelled) return;
    call->is_cancelled = true;
    if (call->cb_depth > 0) {
        call_end_deferred(call, PD_ERR_CLOSED, NULL);  // already ending: is_cancelled mutes on_done
        return;
    }
    if (call->is_ending) return;  // already on the reap list: the reaper frees it
    call_finish(call, PD_ERR_CLOSED, NULL);
}

const char *pd_http_client_call_header(const pd_http_client_call *call, const char *name) {
    struct evhttp_request *req = call->req ? call->req : call->done_req;
    if (!req) return NULL;
    struct evkeyvalq *h = evhttp_request_get_input_headers(req);
    return h ? evhttp_find_header(h, name) : NULL;
}

// ---- libevent callbacks ------------------------------------------------------------------------

static void on_sse_event(const char *event, const char *data, size_t len, void *ud) {
    pd_http_client_call *call = ud;
    if (call->is_ending || !call->cb.on_sse) return;
    call->cb_depth++;
    call->cb.on_sse(call, event, data, len, call->ud);
    call->cb_depth--;
}

// Hands body bytes to on_body and the SSE reader (inside a libevent callback: cb_depth > 0).
static void deliver_body(pd_http_client_call *call, struct evbuffer *in) {
    size_t n = evbuffer_get_length(in);
    if (n == 0 || call->is_ending) return;
    const char *data = (const char *)evbuffer_pullup(in, -1);
    if (!data) return;
    if (call->cb.on_body) call->cb.on_body(call, data, n, call->ud);
    if (call->cb.on_sse && !call->is_ending) {
        pd_status st = pd_http_client_sse_feed(&call->sse, data, n, on_sse_event, call);
        if (st == PD_ERR_PROTO) call_end_deferred(call, st, "bad event stream (line or event too long)");
        else if (st) call_end_deferred(call, st, "out of memory reading the event stream");
    }
}

static int on_ev_headers(struct evhttp_request *req, void *arg) {
    pd_http_client_call *call = arg;
    if (call->is_ending) return 0;
    call->http_status = evhttp_request_get_response_code(req);
    if (call->cb.on_headers) {
        call->cb_depth++;
        call->cb.on_headers(call, call->http_status, call->ud);
        call->cb_depth--;
    }
    return 0;
}

static void on_ev_chunk(struct evhttp_request *req, void *arg) {
    pd_http_client_call *call = arg;
    if (call->is_ending) return;
    call->cb_depth++;
    deliver_body(call, evhttp_request_get_input_buffer(req));
    call->cb_depth--;
}

static void on_ev_error(enum evhttp_request_error error, void *arg) {
    pd_http_client_call *call = arg;
    if (!call->req) return;  // our own cancel
    call->has_ev_error = true;
    call->ev_error = error;
}

static const char *ev_error_msg(pd_http_client_call *call, pd_status *st) {
    *st = PD_ERR_IO;
    // libevent reports a failed connect (refused, unreachable, connect timeout) without an error.
    if (!call->has_ev_error) return "cannot connect (refused, unreachable or timed out)";
    switch (call->ev_error) {
    case EVREQ_HTTP_TIMEOUT: *st = PD_ERR_TIMEOUT; return "read timeout";
    case EVREQ_HTTP_EOF: return "connection closed by the server";
    case EVREQ_HTTP_INVALID_HEADER: *st = PD_ERR_PROTO; return "malformed response";
    case EVREQ_HTTP_DATA_TOO_LONG: *st = PD_ERR_PROTO; return "response too long";
    case EVREQ_HTTP_BUFFER_ERROR: return "buffer error";
    default: return "connection failed (refused or reset)";
    }
}

static void on_ev_done(struct evhttp_request *req, void *arg) {
    pd_http_client_call *call = arg;
    call->req = NULL;  // libevent frees it after we return
    if (call->is_ending) {  // the reaper finishes it
        call_release_conn(call);
        return;
    }
    if (!req || evhttp_request_get_response_code(req) == 0) {
        pd_status st;
        const char *msg = ev_error_msg(call, &st);
        call_finish(call, st, msg);
        return;
    }
    call->http_status = evhttp_request_get_response_code(req);
    call->cb_depth++;
    deliver_body(call, evhttp_request_get_input_buffer(req));
    call->cb_depth--;
    if (call->is_ending) {  // an SSE error or a cancel from on_body/on_sse: the reaper finishes it
        call_release_conn(call);
        return;
    }
    call->done_req = req;
    call_finish(call, PD_OK, NULL);
}

static void on_timeout(evutil_socket_t fd, short what, void *arg) {
    pd_http_client_call *call = arg;
    if (call->is_ending) return;
    char msg[64];
    snprintf(msg, sizeof msg, "timeout after %d ms", call->c->p.request_timeout_ms);
    call_finish(call, PD_ERR_TIMEOUT, msg);
}

// Finishes calls that ended inside libevent or inside their own callbacks.
static void on_reap(evutil_socket_t fd, short what, void *arg) {
    pd_http_client *c = arg;
    while (c->reap) {
        pd_http_client_call *call = c->reap;
        c->reap = call->q_next;
        call->q_next = NULL;
        call_finish(call, call->end_status, call->end_msg);
    }
}

// ================================================================================================
// dispatch
// ================================================================================================

// A connection for host:port: an idle one to the same place, else a new slot, else an idle one
// to elsewhere re-targeted. NULL if every connection is busy (or on OOM).
static conn *conn_get(pd_http_client *c, const char *host, int port) {
    conn *free_slot = NULL, *idle_other = NULL;
    for (int i = 0; i < c->p.max_connections; i++) {
        conn *k = &c->conns[i];
        if (!k->evcon) {
            if (!free_slot) free_slot = k;
            continue;
        }
        if (k->call) continue;
        if (k->port == port && !strcmp(k->host, host)) return k;
        if (!idle_other) idle_other = k;
    }
    conn *k = free_slot;
    if (!k && idle_other) {  // re-target an idle connection
        k = idle_other;
        evhttp_connection_free(k->evcon);
        pd_free(k->host);
        k->evcon = NULL;
        k->host = NULL;
        c->n_conns--;
    }
    if (!k) return NULL;
    k->host = pd_strdup(host);
    if (!k->host) return NULL;
    k->evcon = evhttp_connection_base_new(c->base, NULL, host, (unsigned short)port);
    if (!k->evcon) {
        pd_free(k->host);
        k->host = NULL;
        return NULL;
    }
    k->port = port;
    c->n_conns++;
    struct timeval tv = {c->p.read_timeout_ms / 1000, (c->p.read_timeout_ms % 1000) * 1000};
    evhttp_connection_set_timeout_tv(k->evcon, &tv);
    evhttp_connection_set_retries(k->evcon, 0);
    return k;
}

// Puts one queued call on connection k. PD_OK or an error (the call is then finished by caller).
static pd_status call_start(pd_http_client_call *call, conn *k) {
    struct evhttp_request *req = evhttp_request_new(on_ev_done, call);
    if (!req) return PD_ERR_NOMEM;
    evhttp_request_set_header_cb(req, on_ev_headers);
    evhttp_request_set_chunked_cb(req, on_ev_chunk);
    evhttp_request_set_error_cb(req, on_ev_error);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    char hostport[300];
    if (call->port == 80) snprintf(hostport, sizeof hostport, "%s", call->host);
    else snprintf(hostport, sizeof hostport, "%s:%d", call->host, call->port);
    int rc = evhttp_add_header(h, "Host", hostport);
    for (char **p = call->headers; p && p[0] && p[1] && rc == 0; p += 2) rc = evhttp_add_header(h, p[0], p[1]);
    if (rc == 0 && call->body) {
        char n[32];
        snprintf(n, sizeof n, "%zu", call->body_len);
        rc = evhttp_add_header(h, "Content-Type", call->content_type);
        if (rc == 0) rc = evhttp_add_header(h, "Content-Length", n);
        if (rc == 0) rc = evbuffer_add(evhttp_request_get_output_buffer(req), call->body, call->body_len);
    }
    if (rc != 0) {
        evhttp_request_free(req);
        return PD_ERR_NOMEM;
    }
    call->conn = k;
    k->call = call;
    call->req = req;
    // evhttp_make_request frees req itself when it fails.
    if (evhttp_make_request(k->evcon, req, call->cmd, call->target) != 0) {
        call->req = NULL;
        call_release_conn(call);
        return PD_ERR_IO;
    }
    return PD_OK;
}

static void on_kick(evutil_socket_t fd, short what, void *arg) {
    pd_http_client *c = arg;
    while (c->q_head) {
        pd_http_client_call *call = c->q_head;
        conn *k = conn_get(c, call->host, call->port);
        if (!k) {
            if (c->n_conns == 0) {  // nothing will ever free up: out of memory
                queue_remove(call);
                call_finish(call, PD_ERR_NOMEM, "cannot open a connection");
                continue;
            }
            return;  // wait for a connection to free up
        }
        queue_remove(call);
        pd_status st = call_start(call, k);
        if (st) call_finish(call, st, st == PD_ERR_NOMEM ? "out of memory" : "cannot send the request");
    }
}

// ================================================================================================
// client
// ================================================================================================

pd_http_client *pd_http_client_new(struct event_base *base, const pd_http_client_params *p,
                                   pd_err *err) {
    pd_http_client_params d = pd_http_client_params_default();
    if (!p) p = &d;
    if (!base || p->max_connections < 1 || p->read_timeout_ms < 1 || p->request_timeout_ms < 0) {
        pd_err_set(err, PD_ERR_INVALID, "http client: bad parameters");
        return NULL;
    }
    pd_http_client *c = pd_calloc(1, sizeof *c);
    if (!c) goto nomem;
    c->base = base;
    c->p = *p;
    if (!c->p.max_sse_event_bytes) c->p.max_sse_event_bytes = d.max_sse_event_bytes;
    c->conns = pd_calloc((size_t)p->max_connections, sizeof *c->conns);
    c->ev_kick = event_new(base, -1, 0, on_kick, c);
    c->ev_reap = event_new(base, -1, 0, on_reap, c);
    if (!c->conns || !c->ev_kick || !c->ev_reap) goto nomem;
    return c;
nomem:
    pd_http_client_free(c);
    pd_err_set(err, PD_ERR_NOMEM, "http client: out of memory");
    return NULL;
}

void pd_http_client_free(pd_http_client *c) {
    if (!c) return;
    c->is_freeing = true;
    // Calls on the reap list are already ending: finish them with their own status first.
    if (c->ev_reap) on_reap(-1, 0, c);
    while (c->all) {
        pd_http_client_call *call = c->all;
        call->cb_depth = 0;
        if (call->is_ending && !call->is_cancelled) call->is_ending = false;
        call_finish(call, PD_ERR_CLOSED, "client closed");
    }
    for (int i = 0; c->conns && i < c->p.max_connections; i++) {
        if (c->conns[i].evcon) evhttp_connection_free(c->conns[i].evcon);
        pd_free(c->conns[i].host);
    }
    pd_free(c->conns);
    if (c->ev_kick) event_free(c->ev_kick);
    if (c->ev_reap) event_free(c->ev_reap);
    pd_free(c);
}

int pd_http_client_n_active(const pd_http_client *c) { return c->n_active; }
int pd_http_client_n_connections(const pd_http_client *c) { return c->n_conns; }

// Copies the NULL-terminated name/value list. *out NULL when there is none.
static pd_status copy_headers(const char *const *in, char ***out) {
    *out = NULL;
    if (!in) return PD_OK;
    size_t n = 0;
    while (in[n] && in[n + 1]) n += 2;
    char **h = pd_calloc(n + 1, sizeof *h);
    if (!h) return PD_ERR_NOMEM;
    *out = h;
    for (size_t i = 0; i < n; i++)
        if (!(h[i] = pd_strdup(in[i]))) return PD_ERR_NOMEM;
    return PD_OK;
}

static enum evhttp_cmd_type method_cmd(const char *m, bool *ok) {
    *ok = true;
    if (!m || !strcasecmp(m, "GET")) return EVHTTP_REQ_GET;
    if (!strcasecmp(m, "POST")) return EVHTTP_REQ_POST;
    if (!strcasecmp(m, "PUT")) return EVHTTP_REQ_PUT;
    if (!strcasecmp(m, "DELETE")) return EVHTTP_REQ_DELETE;
    if (!strcasecmp(m, "HEAD")) return EVHTTP_REQ_HEAD;
    *ok = false;
    return EVHTTP_REQ_GET;
}

// Fills host, port and target from the URL.
static pd_status parse_url(pd_http_client_call *call, const char *url, pd_err *err) {
    struct evhttp_uri *u = url ? evhttp_uri_parse(url) : NULL;
    if (!u) return pd_err_set(err, PD_ERR_INVALID, "http client: bad URL '%s'", url ? url : "(null)");
    pd_status st = PD_OK;
    const char *scheme = evhttp_uri_get_scheme(u), *host = evhttp_uri_get_host(u);
    const char *path = evhttp_uri_get_path(u), *query = evhttp_uri_get_query(u);
    if (scheme && !strcasecmp(scheme, "https")) {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "http client: https is not supported (%s)", url);
    } else if (!scheme || strcasecmp(scheme, "http") || !host || !*host) {
        st = pd_err_set(err, PD_ERR_INVALID, "http client: bad URL '%s' (want http://host[:port]/path)", url);
    } else {
        int port = evhttp_uri_get_port(u);
        call->port = port < 0 ? 80 : port;
        if (!path || !*path) path = "/";
        size_t n = strlen(path) + (query ? strlen(query) + 1 : 0) + 1;
        call->target = pd_malloc(n);
        call->host = pd_strdup(host);
        if (!call->target || !call->host) st = pd_err_set(err, PD_ERR_NOMEM, "http client: out of memory");
        else snprintf(call->target, n, "%s%s%s", path, query ? "?" : "", query ? query : "");
    }
    evhttp_uri_free(u);
    return st;
}

pd_http_client_call *pd_http_client_send(pd_http_client *c, const pd_http_client_request *rq,
                                         const pd_http_client_callbacks *cb, void *ud,
                                         pd_err *err) {
    if (c->is_freeing) {
        pd_err_set(err, PD_ERR_CLOSED, "http client: closing");
        return NULL;
    }
    if (!rq || !cb || !cb->on_done) {
        pd_err_set(err, PD_ERR_INVALID, "http client: request and on_done are required");
        return NULL;
    }
    bool ok;
    enum evhttp_cmd_type cmd = method_cmd(rq->method, &ok);
    if (!ok) {
        pd_err_set(err, PD_ERR_INVALID, "http client: unsupported method '%s'", rq->method);
        return NULL;
    }
    pd_http_client_call *call = pd_calloc(1, sizeof *call);
    if (!call) {
        pd_err_set(err, PD_ERR_NOMEM, "http client: out of memory");
        return NULL;
    }
    call->c = c;
    call->cb = *cb;
    call->ud = ud;
    call->cmd = cmd;
    call->next = c->all;  // linked first so that call_free can unlink it on any failure below
    if (c->all) c->all->prev = call;
    c->all = call;
    c->n_active++;
    pd_http_client_sse_init(&call->sse, c->p.max_sse_event_bytes);
    pd_status st = parse_url(call, rq->url, err);
    if (st) goto fail;
    if ((st = copy_headers(rq->headers, &call->headers))) goto nomem;
    if (rq->body) {
        call->body = pd_malloc(rq->body_len + 1);
        call->content_type = pd_strdup(rq->content_type ? rq->content_type : "application/json");
        if (!call->body || !call->content_type) goto nomem;
        memcpy(call->body, rq->body, rq->body_len);
        call->body_len = rq->body_len;
    }
    if (c->p.request_timeout_ms > 0) {
        call->ev_timeout = evtimer_new(c->base, on_timeout, call);
        if (!call->ev_timeout) goto nomem;
        struct timeval tv = {c->p.request_timeout_ms / 1000, (c->p.request_timeout_ms % 1000) * 1000};
        evtimer_add(call->ev_timeout, &tv);
    }
    call->is_queued = true;
    if (c->q_tail) c->q_tail->q_next = call;
    else c->q_head = call;
    c->q_tail = call;
    event_active(c->ev_kick, EV_TIMEOUT, 1);
    return call;
nomem:
    pd_err_set(err, PD_ERR_NOMEM, "http client: out of memory");
fail:
    call_free(call);
    return NULL;
}

// ---- one blocking request -----------------------------------------------------------------------

typedef struct fetch_state {
    struct event_base *base;
    pd_buf body;
    bool oom;
    pd_status status;
    int http_status;
    char msg[160];
} fetch_state;

static void fetch_body(pd_http_client_call *call, const char *data, size_t len, void *ud) {
    fetch_state *f = ud;
    if (!f->oom && pd_buf_append(&f->body, data, len) != PD_OK) f->oom = true;
}

static void fetch_done(pd_http_client_call *call, pd_status status, int http_status, const char *msg, void *ud) {
    fetch_state *f = ud;
    f->status = status;
    f->http_status = http_status;
    snprintf(f->msg, sizeof f->msg, "%s", msg);
    event_base_loopbreak(f->base);
}

pd_status pd_http_fetch(const pd_http_client_request *rq, int timeout_ms, int *http_status, char **body,
                        size_t *body_len, pd_err *err) {
    pd_err local = {0};
    if (!err) err = &local;
    *body = NULL;
    fetch_state f = {0};
    if (!(f.base = event_base_new())) return pd_err_set(err, PD_ERR_NOMEM, "http fetch: no event loop");
    pd_http_client_params cp = pd_http_client_params_default();
    cp.max_connections = 1;
    if (timeout_ms > 0) cp.read_timeout_ms = cp.request_timeout_ms = timeout_ms;
    pd_http_client *c = pd_http_client_new(f.base, &cp, err);
    pd_status st;
    if (!c) {
        st = err->status;
    } else if (!pd_http_client_send(c, rq, &(pd_http_client_callbacks){.on_body = fetch_body, .on_done = fetch_done}, &f,
                                    err)) {
        st = err->status;
    } else {
        event_base_dispatch(f.base);  // until fetch_done breaks the loop
        st = f.oom ? PD_ERR_NOMEM : f.status;
        if (st) pd_err_set(err, st, "%s", f.oom ? "http fetch: out of memory" : f.msg);
    }
    pd_http_client_free(c);
    event_base_free(f.base);
    size_t n = f.body.len;
    char *p = st ? NULL : pd_buf_take(&f.body);
    if (!st && !p) st = pd_err_set(err, PD_ERR_NOMEM, "http fetch: out of memory");
    if (st) {
        pd_buf_free(&f.body);
        return st;
    }
    *body = p;
    if (body_len) *body_len = n;
    *http_status = f.http_status;
    return PD_OK;
}
