// server.c — pd_http_server: evhttp listener, route table, request wrappers, replies and SSE.
//
// Every request that reaches a handler gets a pd_http_req wrapper (pd_malloc'ed) that sits on the
// server's active list until it is ended. While a wrapper is live, its connection's close callback
// points at it; ending the request clears that callback first, so a keep-alive connection that
// later closes never calls into a freed wrapper. evhttp serves one request per connection at a
// time (it reads the next one only after the reply), so connection → wrapper is one-to-one.
//
// Client disconnect: libevent 2.1 stops reading a server connection once a request has been read,
// so it would only notice a vanished client when a write fails. While a handler holds a request
// we therefore watch the socket ourselves (on_watch): readable + recv(MSG_PEEK) == 0 or an error
// means the client is gone, and we free the connection. evhttp_connection_free runs our close
// callback (before it frees the evhttp_request); we run the handler's close callback and free the
// wrapper. A failed write mid-stream takes the same path inside libevent. Readable with data means
// a pipelined next request: we stop watching (it is read after the reply).
#include "base/buf.h"
#include "http/http.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <pthread.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <event2/listener.h>
#include <sys/queue.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <stdio.h>
#include <string.h>

#define PD_HTTP_MAX_ROUTES 64

// One accepted connection (see "connection accounting" below). Indexed by its fd in
// pd_http_server.conns once the fd is known; the bufferevent holds an extra reference of ours so
// that the fd stays open (and its number ours) until we release it.
typedef struct http_gate http_gate;

typedef struct http_conn {
    struct bufferevent *bev;   // NULL = slot unused
    http_gate *gate;           // the connection's error gate (NULL only after OOM)
    int64_t t_idle_us;         // accepted, or its last request ended
    int64_t t_input_us;        // when the sweep first saw bytes of a request; 0 = none
    int n_busy;                // requests of this connection held by handlers
    bool is_shed;              // shut down by us, waiting for evhttp to free it
} http_conn;

typedef struct http_pending {
    struct bufferevent *bev;
    http_gate *gate;
    bool refuse;               // over max_connections with nothing idle: shut it down at once
} http_pending;

typedef struct route {
    char *method;  // owned
    char *path;    // owned
    pd_http_handler_fn fn;
    void *ud;
} route;

struct pd_http_server {
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *sock;
    int port;
    size_t max_body_bytes;
    pd_http_response_fn on_response;
    void *on_response_ud;
    route routes[PD_HTTP_MAX_ROUTES];
    int n_routes;
    pd_http_req *active;  // doubly linked list of live wrappers
    int n_active;
    pd_http_req *in_handler;  // the request whose handler is running (NULL once it ends)
    // connection accounting
    struct evconnlistener *listener;  // evhttp's, borrowed
    http_conn *conns;                 // (n_conn_slots) indexed by fd
    int n_conn_slots;
    size_t cap_conns;                 // allocated slots (>= n_conn_slots)
    http_pending *pending;            // new bufferevents whose fd is not set yet
    int n_pending;
    size_t cap_pending;
    int n_conns;                      // accepted and not yet released
    int n_shedding;                   // of them, shut down by us and not yet released
    int *shed_fds;                    // (n_shedding) their fds, to release them without a full scan
    size_t cap_shed;
    int max_connections;
    int64_t header_timeout_us, keepalive_timeout_us;
    struct event *sweep, *resume, *kick;  // periodic sweep; accept re-enable; refusal
    int backoff_ms;
    int64_t t_last_emfile_log_us;
    int64_t n_emfile, n_shed, n_emfile_logged;
    pd_http_server *next_server;      // the listener registry (on_accept_error)
    bool is_draining;         // pd_http_server_drain: POSTs get 503, replies close the connection
    int retry_after_s;
    int n_writing;            // > 0 while our own code writes a reply (see the error gate)
    // While draining: connections whose request ended, until libevent frees them (their close
    // callback is on_flush_close) or a new request on them gets a wrapper (see flush_untrack).
    struct evhttp_connection **flushing;
    int n_flushing;
    size_t cap_flushing;
};

struct pd_http_req {
    pd_http_server *srv;
    struct evhttp_request *ev;
    struct evhttp_connection *evcon;
    char *path;  // owned
    const char *body;
    size_t body_len;
    pd_http_close_fn close_fn;
    void *close_ud;
    bool is_streaming;
    bool has_query;               // query parsed into `query`
    struct evkeyvalq query;       // the query string's parameters (evhttp_parse_query_str)
    struct event *watch;  // EOF watch on the socket while a handler holds r (see on_watch)
    pd_http_req *prev, *next;
};

pd_http_params pd_http_params_default(void) {
    pd_http_params p = {0};
    p.host = "127.0.0.1";
    p.port = 0;
    p.max_body_bytes = (size_t)8 << 20;
    p.timeout_s = 60;
    p.header_timeout_s = 60;
    p.keepalive_timeout_s = 30;
    p.max_connections = 0;
    return p;
}

// ---- wrapper lifecycle -------------------------------------------------------------------------

static void on_conn_close(struct evhttp_connection *evcon, void *arg);
static void conn_note_busy(pd_http_server *s, struct evhttp_connection *evcon, bool busy);

static void flush_untrack(pd_http_server *s, struct evhttp_connection *evcon) {
    for (int i = 0; i < s->n_flushing; i++)
        if (s->flushing[i] == evcon) {
            s->flushing[i] = s->flushing[--s->n_flushing];
            return;
        }
}

static void on_flush_close(struct evhttp_connection *evcon, void *arg) { flush_untrack(arg, evcon); }

// A request ended while draining: remember its connection until its reply bytes are written
// (pd_http_server_n_unflushed). Untracked (and not waited for) when out of memory.
static void flush_track(pd_http_server *s, struct evhttp_connection *evcon) {
    flush_untrack(s, evcon);
    if (PD_ARRAY_RESERVE(s->flushing, s->cap_flushing, (size_t)s->n_flushing + 1) != PD_OK) return;
    s->flushing[s->n_flushing++] = evcon;
    evhttp_connection_set_closecb(evcon, on_flush_close, s);
}

static pd_http_req *req_new(pd_http_server *s, struct evhttp_request *ev, const char *path) {
    pd_http_req *r = pd_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->path = pd_strdup(path);
    if (!r->path) {
        pd_free(r);
        return NULL;
    }
    r->srv = s;
    r->ev = ev;
    r->evcon = evhttp_request_get_connection(ev);
    r->next = s->active;
    if (s->active) s->active->prev = r;
    s->active = r;
    s->n_active++;
    if (r->evcon) flush_untrack(s, r->evcon);
    if (r->evcon) evhttp_connection_set_closecb(r->evcon, on_conn_close, r);
    conn_note_busy(s, r->evcon, true);
    return r;
}

// Unlinks and frees the wrapper; detaches it from its connection first.
static void req_end(pd_http_req *r) {
    pd_http_server *s = r->srv;
    if (s->in_handler == r) s->in_handler = NULL;
    if (r->watch) event_free(r->watch);
    if (r->has_query) evhttp_clear_headers(&r->query);
    if (r->evcon) evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    conn_note_busy(s, r->evcon, false);
    if (r->evcon && s->is_draining) flush_track(s, r->evcon);
    if (r->prev) r->prev->next = r->next;
    else s->active = r->next;
    if (r->next) r->next->prev = r->prev;
    s->n_active--;
    pd_free(r->path);
    pd_free(r);
}

static void on_conn_close(struct evhttp_connection *evcon, void *arg) {
    pd_http_req *r = arg;
    PD_UNUSED(evcon);
    // When libevent itself sees the failure (a chunk write to a closed socket) while a reply is
    // unfinished, it detaches the request from the connection before freeing the connection and
    // leaves the request to its user (evhttp_connection_incoming_fail): free it here.
    struct evhttp_request *detached = r->ev && !evhttp_request_get_connection(r->ev) ? r->ev : NULL;
    r->evcon = NULL;  // being freed by libevent: nothing to detach
    r->ev = NULL;
    if (r->close_fn) r->close_fn(r, r->close_ud);
    req_end(r);
    if (detached) evhttp_request_free(detached);
}

static void on_watch(evutil_socket_t fd, short what, void *arg) {
    pd_http_req *r = arg;
    PD_UNUSED(what);
    char c;
    ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k > 0 || (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) {
        if (k > 0) event_del(r->watch);  // pipelined data: libevent reads it after the reply
        return;
    }
    // EOF or a socket error: the client is gone. This runs on_conn_close (which frees r).
    if (r->evcon) evhttp_connection_free(r->evcon);
}

// Starts the EOF watch for a request its handler kept.
static void req_watch(pd_http_req *r) {
    if (!r->evcon || r->watch) return;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(r->evcon);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return;
    r->watch = event_new(r->srv->base, fd, EV_READ | EV_PERSIST, on_watch, r);
    if (r->watch) event_add(r->watch, NULL);
}

static void note_status(pd_http_server *s, int status) {
    if (s->on_response) s->on_response(status, s->on_response_ud);
}

// ---- replies -----------------------------------------------------------------------------------

const char *pd_http_status_reason(int status) {
    switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
    }
}

void pd_http_reply_header(pd_http_req *r, const char *name, const char *value) {
    if (!r->ev) return;
    evhttp_add_header(evhttp_request_get_output_headers(r->ev), name, value);
}

void pd_http_reply(pd_http_req *r, int status, const char *content_type, const char *body,
                   size_t len) {
    struct evhttp_request *ev = r->ev;
    pd_http_server *s = r->srv;
    if (r->evcon) evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    if (ev) {
        struct evbuffer *buf = evbuffer_new();
        if (buf && len) evbuffer_add(buf, body, len);
        if (content_type)
            evhttp_add_header(evhttp_request_get_output_headers(ev), "Content-Type", content_type);
        s->n_writing++;
        evhttp_send_reply(ev, status, pd_http_status_reason(status), buf);
        s->n_writing--;
        if (buf) evbuffer_free(buf);
    }
    note_status(s, status);
    req_end(r);
}

void pd_http_reply_json(pd_http_req *r, int status, json_t *obj) {
    char *s = json_dumps(obj, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!s) {
        pd_http_reply(r, 500, "application/json", "{}", 2);
        return;
    }
    pd_http_reply(r, status, "application/json", s, strlen(s));
    free(s);  // jansson allocates with malloc
}

json_t *pd_http_error_body(const char *type, const char *message, const char *param,
                           const char *code) {
    json_t *inner = json_object();
    json_t *outer = json_object();
    if (!inner || !outer) goto fail;
    if (json_object_set_new(inner, "message", json_string(message ? message : "")) ||
        json_object_set_new(inner, "type", json_string(type ? type : "invalid_request_error")) ||
        json_object_set_new(inner, "param", param ? json_string(param) : json_null()) ||
        json_object_set_new(inner, "code", code ? json_string(code) : json_null()))
        goto fail;
    if (json_object_set_new(outer, "error", inner)) {
        inner = NULL;  // set_new stole it even on failure
        goto fail;
    }
    return outer;
fail:
    json_decref(inner);
    json_decref(outer);
    return NULL;
}

void pd_http_reply_error(pd_http_req *r, int status, const char *type, const char *message,
                         const char *param, const char *code) {
    json_t *o = pd_http_error_body(type, message, param, code);
    if (!o) {
        pd_http_reply(r, 500, "application/json", "{}", 2);
        return;
    }
    pd_http_reply_json(r, status, o);
    json_decref(o);
}

// ---- SSE ---------------------------------------------------------------------------------------

int pd_http_sse_frame(struct evbuffer *out, const char *data, size_t len) {
    size_t i = 0;
    do {
        const char *nl = len > i ? memchr(data + i, '\n', len - i) : NULL;
        size_t n = nl ? (size_t)(nl - (data + i)) : len - i;
        // A CR before the newline would end the line early for SSE parsers: drop it.
        size_t n_line = (n && data[i + n - 1] == '\r') ? n - 1 : n;
        if (evbuffer_add(out, "data: ", 6) || evbuffer_add(out, data + i, n_line) ||
            evbuffer_add(out, "\n", 1))
            return -1;
        i += n + 1;
    } while (i < len);
    return evbuffer_add(out, "\n", 1);
}

void pd_http_sse_begin(pd_http_req *r) {
    r->is_streaming = true;
    if (!r->ev) return;
    struct evkeyvalq *h = evhttp_request_get_output_headers(r->ev);
    evhttp_add_header(h, "Content-Type", "text/event-stream; charset=utf-8");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    r->srv->n_writing++;
    evhttp_send_reply_start(r->ev, 200, "OK");
    r->srv->n_writing--;
    note_status(r->srv, 200);
}

void pd_http_sse_send(pd_http_req *r, const char *data, size_t len) {
    if (!r->ev) return;
    struct evbuffer *buf = evbuffer_new();
    if (!buf) return;
    if (pd_http_sse_frame(buf, data, len) == 0) {
        r->srv->n_writing++;
        evhttp_send_reply_chunk(r->ev, buf);
        r->srv->n_writing--;
    }
    evbuffer_free(buf);
}

void pd_http_sse_send_json(pd_http_req *r, json_t *obj) {
    char *s = json_dumps(obj, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!s) return;
    pd_http_sse_send(r, s, strlen(s));
    free(s);
}

void pd_http_sse_end(pd_http_req *r, bool send_done) {
    if (r->evcon) evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    if (r->ev) {
        if (send_done) pd_http_sse_send(r, "[DONE]", 6);
        r->srv->n_writing++;
        evhttp_send_reply_end(r->ev);
        r->srv->n_writing--;
    }
    req_end(r);
}

// ---- accessors ---------------------------------------------------------------------------------

const char *pd_http_req_method(const pd_http_req *r) {
    if (!r->ev) return "";
    switch (evhttp_request_get_command(r->ev)) {
    case EVHTTP_REQ_GET: return "GET";
    case EVHTTP_REQ_POST: return "POST";
    case EVHTTP_REQ_HEAD: return "HEAD";
    case EVHTTP_REQ_PUT: return "PUT";
    case EVHTTP_REQ_DELETE: return "DELETE";
    case EVHTTP_REQ_OPTIONS: return "OPTIONS";
    case EVHTTP_REQ_TRACE: return "TRACE";
    case EVHTTP_REQ_CONNECT: return "CONNECT";
    case EVHTTP_REQ_PATCH: return "PATCH";
    default: return "";
    }
}

const char *pd_http_req_path(const pd_http_req *r) { return r->path; }

const char *pd_http_req_body(pd_http_req *r, size_t *len) {
    *len = r->body_len;
    return r->body ? r->body : "";
}

const char *pd_http_req_header(const pd_http_req *r, const char *name) {
    if (!r->ev) return NULL;
    return evhttp_find_header(evhttp_request_get_input_headers(r->ev), name);
}

const char *pd_http_req_query(pd_http_req *r, const char *name) {
    if (!r->has_query) {
        if (!r->ev) return NULL;
        const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(r->ev);
        const char *q = uri ? evhttp_uri_get_query(uri) : NULL;
        TAILQ_INIT(&r->query);
        r->has_query = true;
        if (q && evhttp_parse_query_str(q, &r->query)) {
            evhttp_clear_headers(&r->query);
            return NULL;
        }
    }
    return evhttp_find_header(&r->query, name);
}

void pd_http_req_set_close_cb(pd_http_req *r, pd_http_close_fn fn, void *ud) {
    r->close_fn = fn;
    r->close_ud = ud;
}

size_t pd_http_req_n_pending_bytes(const pd_http_req *r) {
    if (!r->evcon) return 0;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(r->evcon);
    return bev ? evbuffer_get_length(bufferevent_get_output(bev)) : 0;
}

// ---- dispatch ----------------------------------------------------------------------------------

// Replies to a request that has no wrapper with an OpenAI-shaped error; retry_after_s > 0 adds
// Retry-After.
static void reply_raw(pd_http_server *s, struct evhttp_request *ev, int status, const char *type,
                      const char *msg, const char *allow, const char *code, int retry_after_s) {
    json_t *o = pd_http_error_body(type, msg, NULL, code);
    char *txt = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    struct evbuffer *buf = evbuffer_new();
    if (buf) evbuffer_add_printf(buf, "%s", txt ? txt : "{}");
    struct evkeyvalq *h = evhttp_request_get_output_headers(ev);
    evhttp_add_header(h, "Content-Type", "application/json");
    if (allow) evhttp_add_header(h, "Allow", allow);
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after_s);
        evhttp_add_header(h, "Retry-After", ra);
    }
    s->n_writing++;
    evhttp_send_reply(ev, status, pd_http_status_reason(status), buf);
    s->n_writing--;
    if (buf) evbuffer_free(buf);
    free(txt);
    json_decref(o);
    note_status(s, status);
}

// Routing errors, OOM.
static void reply_raw_error(pd_http_server *s, struct evhttp_request *ev, int status,
                            const char *msg, const char *allow) {
    reply_raw(s, ev, status, "invalid_request_error", msg, allow, NULL, 0);
}

// Replies and SSE chunks are many small writes: with Nagle's algorithm a chunk waits for the ACK of
// the previous one, and a delayed ACK holds it ~40 ms (seen as 44 ms inter-token gaps and TTFT
// tails in GPU serving). Set per request: idempotent, one syscall, and covers keep-alive reuse.
static void set_nodelay(struct evhttp_request *ev) {
    struct evhttp_connection *con = evhttp_request_get_connection(ev);
    struct bufferevent *bev = con ? evhttp_connection_get_bufferevent(con) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    int one = 1;
    if (fd >= 0) (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void on_request(struct evhttp_request *ev, void *arg) {
    pd_http_server *s = arg;
    set_nodelay(ev);
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(ev);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    if (!path || !*path) path = "/";
    pd_http_req tmp = {.ev = ev};
    const char *method = pd_http_req_method(&tmp);
    if (s->is_draining) evhttp_add_header(evhttp_request_get_output_headers(ev), "Connection", "close");

    const route *hit = NULL;
    char allow[128] = "";
    for (int i = 0; i < s->n_routes; i++) {
        if (strcmp(s->routes[i].path, path)) continue;
        if (!strcmp(s->routes[i].method, method)) hit = &s->routes[i];
        else if (strlen(allow) + strlen(s->routes[i].method) + 3 < sizeof allow) {
            if (*allow) strcat(allow, ", ");
            strcat(allow, s->routes[i].method);
        }
    }
    char msg[512];
    if (!hit) {
        bool known = *allow != 0;
        snprintf(msg, sizeof msg, "%s (%s %.400s)", known ? "Method not allowed" : "Invalid URL",
                 method, path);
        reply_raw_error(s, ev, known ? 405 : 404, msg, known ? allow : NULL);
        return;
    }
    if (s->is_draining && strcmp(method, "GET") && strcmp(method, "HEAD")) {
        reply_raw(s, ev, 503, "server_error", "the server is shutting down (draining); retry on another instance",
                  NULL, "draining", s->retry_after_s);
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(ev);
    size_t n = evbuffer_get_length(in);
    if (n > s->max_body_bytes) {
        snprintf(msg, sizeof msg, "request body too large: %zu bytes (limit %zu)", n,
                 s->max_body_bytes);
        reply_raw(s, ev, 413, "invalid_request_error", msg, NULL, "request_too_large", 0);
        return;
    }
    pd_http_req *r = req_new(s, ev, path);
    if (!r || evbuffer_add(in, "", 1)) {  // NUL-terminate the body for the handler
        if (r) req_end(r);
        reply_raw_error(s, ev, 500, "out of memory", NULL);
        return;
    }
    r->body = (const char *)evbuffer_pullup(in, -1);
    r->body_len = n;
    s->in_handler = r;
    hit->fn(r, hit->ud);
    if (s->in_handler == r) {  // the handler kept r: watch for the client going away
        s->in_handler = NULL;
        req_watch(r);
    }
}

// ---- the error gate ----------------------------------------------------------------------------
// libevent 2.1 answers some requests itself, before any callback of ours runs, with an HTML page:
// 400 (a malformed request line, header or Content-Length; a request line or headers over the
// header limit), 413 (a body over evhttp's max_body_size, by Content-Length or while reading a
// chunked body; a malformed chunk), 417 (an Expect other than 100-continue) and 501 (a method it
// does not know or we do not allow). 2.1 has no hook for those replies (evhttp_set_errorcb and
// evhttp_set_newreqcb came in 2.2), but every connection's bufferevent is ours (evhttp_set_bevcb),
// so each gets a gate:
//   * a callback on the bufferevent's output buffer sees every byte queued for the client. Our
//     own replies are written with n_writing raised; bytes evhttp queues on its own are its 100
//     Continue (passed through) or the start of an error reply ("HTTP/1.1 413 ..."): the gate
//     drops them, queues the same status with an OpenAI-shaped JSON body and "Connection: close"
//     in their place, and freezes the buffer's end so the rest of evhttp's page (headers, HTML)
//     is refused. evhttp then writes our bytes, frees the connection (its page said close) and
//     shuts the socket down for writing;
//   * from then on the input is discarded as it arrives (a callback on the input buffer), so an
//     upload that goes on after the refusal costs no memory and the client, which may still be
//     sending, reads the reply instead of a reset. The socket is closed by the sweep once the
//     client has closed its side, has sent nothing for HTTP_LINGER_IDLE_US, or after
//     HTTP_LINGER_MAX_US (nginx's lingering_timeout / lingering_time);
//   * evhttp's max_body_size is the body limit itself, so it stops reading a body at the limit
//     (by Content-Length before the body, chunked as soon as the sizes add up past it): a refused
//     body is never held beyond the limit plus one chunk of at most the limit.
// Timeouts send no reply (evhttp and the sweep close the connection), so they need no JSON.
#define HTTP_LINGER_IDLE_US (2 * 1000000)
#define HTTP_LINGER_MAX_US (10 * 1000000)
#define HTTP_MAX_HEADERS (64 << 10)

struct http_gate {
    pd_http_server *s;
    struct bufferevent *bev;
    struct evbuffer_cb_entry *out_cb, *in_cb;
    int64_t t_refused_us, t_last_input_us;
    uint64_t n_discarded;
    bool busy;     // the gate is editing a buffer (its own edits re-enter its callbacks)
    bool refused;  // evhttp's error reply was replaced; input is discarded
    bool shut;     // the reply is written and the socket shut down for writing
};

static void note_status(pd_http_server *s, int status);

static void gate_on_input(struct evbuffer *in, const struct evbuffer_cb_info *info, void *arg) {
    http_gate *g = arg;
    if (g->busy || !info->n_added) return;
    g->busy = true;
    size_t n = evbuffer_get_length(in);
    g->n_discarded += n;
    g->t_last_input_us = pd_time_us();
    evbuffer_drain(in, n);
    g->busy = false;
}

// The JSON error that replaces evhttp's page for status.
static json_t *gate_error_body(const pd_http_server *s, int status) {
    char msg[256];
    const char *code;
    switch (status) {
    case 400:
        snprintf(msg, sizeof msg, "malformed HTTP request (request line, a header or Content-Length), or request "
                 "line and headers over %d KiB", HTTP_MAX_HEADERS >> 10);
        code = "bad_request";
        break;
    case 413:
        snprintf(msg, sizeof msg, "request body too large (limit %zu bytes), or a malformed chunked body",
                 s->max_body_bytes);
        code = "request_too_large";
        break;
    case 417:
        snprintf(msg, sizeof msg, "unsupported Expect header (only 100-continue is supported)");
        code = "expectation_failed";
        break;
    case 501:
        snprintf(msg, sizeof msg, "method not implemented (allowed: GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH)");
        code = "method_not_implemented";
        break;
    default:
        snprintf(msg, sizeof msg, "HTTP error %d", status);
        code = "http_error";
        break;
    }
    return pd_http_error_body(status >= 500 && status != 501 ? "server_error" : "invalid_request_error", msg, NULL,
                              code);
}

static void gate_refuse(http_gate *g, struct evbuffer *out, size_t start, int status) {
    pd_http_server *s = g->s;
    g->busy = true;
    // Drop evhttp's bytes, keep what was queued before them (an unsent 100 Continue).
    if (start == 0) {
        evbuffer_drain(out, evbuffer_get_length(out));
    } else {
        struct evbuffer *keep = evbuffer_new();
        if (keep) evbuffer_remove_buffer(out, keep, start);
        evbuffer_drain(out, evbuffer_get_length(out));
        if (keep) {
            evbuffer_add_buffer(out, keep);
            evbuffer_free(keep);
        }
    }
    json_t *o = gate_error_body(s, status);
    char *txt = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    const char *body = txt ? txt : "{}";
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                        "Connection: close\r\n\r\n%s", status, pd_http_status_reason(status), strlen(body), body);
    free(txt);
    json_decref(o);
    evbuffer_freeze(out, 0);  // the rest of evhttp's reply is refused
    // Discard the input from now on (whatever evhttp had buffered of the request too).
    struct evbuffer *in = bufferevent_get_input(g->bev);
    g->n_discarded += evbuffer_get_length(in);
    evbuffer_drain(in, evbuffer_get_length(in));
    g->in_cb = evbuffer_add_cb(in, gate_on_input, g);
    g->refused = true;
    g->t_refused_us = g->t_last_input_us = pd_time_us();
    g->busy = false;
    PD_LOG_D("http: refused a request with %d (JSON error in place of libevent's page)", status);
    note_status(s, status);
}

static void gate_on_output(struct evbuffer *out, const struct evbuffer_cb_info *info, void *arg) {
    http_gate *g = arg;
    if (g->refused && !g->shut && info->n_deleted && !evbuffer_get_length(out)) {
        // Our reply is written: end the connection's sending side. evhttp frees the connection
        // itself after an error page, except on a CONNECT request, which it would keep alive.
        evutil_socket_t fd = bufferevent_getfd(g->bev);
        if (fd >= 0) shutdown(fd, SHUT_WR);
        g->shut = true;
        return;
    }
    if (g->busy || g->refused || !info->n_added || g->s->n_writing > 0) return;
    // evhttp wrote on its own: the new bytes (at the end) start a status line.
    // A socket bufferevent keeps its output's front frozen except while it writes: thaw it to
    // read and edit (nothing is written meanwhile: this runs inside evhttp's evbuffer_add).
    evbuffer_unfreeze(out, 1);
    size_t len = evbuffer_get_length(out);
    size_t start = len >= info->n_added ? len - info->n_added : 0;
    char head[24] = "";
    struct evbuffer_ptr at;
    if (evbuffer_ptr_set(out, &at, start, EVBUFFER_PTR_SET) == 0) {
        ev_ssize_t k = evbuffer_copyout_from(out, &at, head, PD_MIN(sizeof head - 1, (size_t)info->n_added));
        head[k > 0 ? k : 0] = 0;
    }
    int major = 0, minor = 0, status = 0;
    if (sscanf(head, "HTTP/%d.%d %d", &major, &minor, &status) != 3 || status < 100 || status > 599) status = 500;
    if (status != 100) gate_refuse(g, out, start, status);  // 100 Continue: interim, passed on
    evbuffer_freeze(out, 1);
}

static http_gate *gate_new(pd_http_server *s, struct bufferevent *bev) {
    http_gate *g = pd_calloc(1, sizeof *g);
    if (!g) return NULL;
    g->s = s;
    g->bev = bev;
    g->out_cb = evbuffer_add_cb(bufferevent_get_output(bev), gate_on_output, g);
    if (!g->out_cb) {
        pd_free(g);
        return NULL;
    }
    return g;
}

// Before the bufferevent is released.
static void gate_free(http_gate *g) {
    if (!g) return;
    if (g->out_cb) evbuffer_remove_cb_entry(bufferevent_get_output(g->bev), g->out_cb);
    if (g->in_cb) evbuffer_remove_cb_entry(bufferevent_get_input(g->bev), g->in_cb);
    pd_free(g);
}

// A refused connection evhttp has freed stays open while the client may still be sending.
static bool gate_lingers(const http_gate *g, int64_t now) {
    if (!g || !g->refused) return false;
    if (!(bufferevent_get_enabled(g->bev) & EV_READ)) return false;  // EOF or an error: done
    return now - g->t_last_input_us < HTTP_LINGER_IDLE_US && now - g->t_refused_us < HTTP_LINGER_MAX_US;
}

// ---- connection accounting ---------------------------------------------------------------------
// evhttp (libevent 2.1) neither limits connections nor separates a header deadline from the
// keep-alive idle time, and without an error callback its listener logs every failed accept() and
// spins on a full fd table. Like nginx we therefore:
//   * count connections: evhttp asks us for each new connection's bufferevent (evhttp_set_bevcb);
//     we create it with one extra reference, so evhttp freeing the connection leaves it (and its
//     fd, BEV_OPT_CLOSE_ON_FREE) alive until our sweep sees its callbacks cleared and drops it;
//   * at max_connections, close the longest-idle connections (no request held, nothing unread,
//     32 at a time, nginx's ngx_drain_connections) so a new client, a health check say, still
//     gets in (fewer at a time under a small limit: a sixteenth of it); with none idle the newest
//     is closed instead. A closed connection's fd is released
//     by the next sweep; until then it does not count against the limit;
//   * close a connection idle for keepalive_timeout_s, or one whose request has not arrived
//     complete header_timeout_s after its first bytes were seen (slow-loris), in a sweep every
//     500 ms (libevent's own timeout_s still bounds each read and write);
//   * on EMFILE / ENFILE / ENOBUFS / ENOMEM from accept(): pause the listener, shed idle
//     connections and resume after a short backoff (100 ms doubling to 1 s), logging at most one
//     line per 10 s with a count.
#define HTTP_SHED_BATCH 32

// Connections closed per shedding pass: 32 (nginx), fewer under a small limit (a sixteenth of it)
// so that a pass never empties the server of its recent connections.
static int shed_batch(const pd_http_server *s) { return PD_MAX(1, PD_MIN(HTTP_SHED_BATCH, s->max_connections / 16)); }

static http_conn *conn_slot(pd_http_server *s, evutil_socket_t fd) {
    if (fd < 0) return NULL;
    if (fd >= s->n_conn_slots) {
        if (fd > INT_MAX - 1024 || PD_ARRAY_RESERVE(s->conns, s->cap_conns, (size_t)fd + 1024) != PD_OK) return NULL;
        int n = (int)PD_MIN(s->cap_conns, (size_t)INT_MAX);
        memset(s->conns + s->n_conn_slots, 0, (size_t)(n - s->n_conn_slots) * sizeof *s->conns);
        s->n_conn_slots = n;
    }
    return &s->conns[fd];
}

static bool bev_is_freed(struct bufferevent *bev) {
    bufferevent_data_cb rd = NULL, wr = NULL;
    bufferevent_event_cb ev = NULL;
    void *arg = NULL;
    bufferevent_getcb(bev, &rd, &wr, &ev, &arg);
    return !rd && !wr && !ev;
}

static void conn_shed(pd_http_server *s, http_conn *c);

// Moves bufferevents whose fd is now set into the fd-indexed table.
static void conns_resolve(pd_http_server *s) {
    int k = 0;
    for (int i = 0; i < s->n_pending; i++) {
        struct bufferevent *bev = s->pending[i].bev;
        evutil_socket_t fd = bufferevent_getfd(bev);
        http_conn *c = fd >= 0 ? conn_slot(s, fd) : NULL;
        if (c && !c->bev) {
            memset(c, 0, sizeof *c);
            c->bev = bev;
            c->gate = s->pending[i].gate;
            c->t_idle_us = pd_time_us();
            if (s->pending[i].refuse) conn_shed(s, c);
        } else if (fd < 0 && bev_is_freed(bev)) {  // evhttp gave up before setting the fd
            gate_free(s->pending[i].gate);
            bufferevent_decref(bev);
            s->n_conns--;
        } else {
            s->pending[k++] = s->pending[i];
        }
    }
    s->n_pending = k;
}

static void conn_release(pd_http_server *s, http_conn *c) {
    gate_free(c->gate);
    bufferevent_decref(c->bev);  // closes the fd
    if (c->is_shed) {
        int fd = (int)(c - s->conns);
        for (int i = 0; i < s->n_shedding; i++)
            if (s->shed_fds[i] == fd) {
                s->shed_fds[i] = s->shed_fds[--s->n_shedding];
                break;
            }
    }
    memset(c, 0, sizeof *c);
    s->n_conns--;
}

// Releases the fds of shed connections evhttp has freed already (cheap: only those are looked at).
static void conns_release_shed(pd_http_server *s) {
    int64_t now = pd_time_us();
    for (int i = s->n_shedding - 1; i >= 0; i--) {
        http_conn *c = &s->conns[s->shed_fds[i]];
        if (c->bev && bev_is_freed(c->bev) && !gate_lingers(c->gate, now)) conn_release(s, c);
    }
}

static bool conn_is_idle(const http_conn *c) {
    if (c->n_busy > 0 || c->is_shed || bev_is_freed(c->bev)) return false;
    return evbuffer_get_length(bufferevent_get_input(c->bev)) == 0 &&
           evbuffer_get_length(bufferevent_get_output(c->bev)) == 0;
}

static void conn_shed(pd_http_server *s, http_conn *c) {
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    // evhttp reads EOF, frees the connection; the sweep then releases the fd
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
    if (PD_ARRAY_RESERVE(s->shed_fds, s->cap_shed, (size_t)s->n_shedding + 1) != PD_OK)
        return;  // not marked: the keep-alive sweep releases it like any closed connection
    s->shed_fds[s->n_shedding++] = (int)(c - s->conns);
    c->is_shed = true;
    s->n_shed++;
}

// Closes up to n (<= HTTP_SHED_BATCH) of the longest-idle connections in one pass over the table.
// Returns how many.
static int conns_shed_idle(pd_http_server *s, int n) {
    http_conn *pick[HTTP_SHED_BATCH];
    int k = 0;
    n = PD_MIN(n, HTTP_SHED_BATCH);
    for (int fd = 0; fd < s->n_conn_slots; fd++) {
        http_conn *c = &s->conns[fd];
        if (!c->bev || !conn_is_idle(c)) continue;
        if (k < n) {
            pick[k++] = c;
            continue;
        }
        int newest = 0;  // replace the most recently idle of the picks if c is older
        for (int i = 1; i < k; i++)
            if (pick[i]->t_idle_us > pick[newest]->t_idle_us) newest = i;
        if (c->t_idle_us < pick[newest]->t_idle_us) pick[newest] = c;
    }
    for (int i = 0; i < k; i++) conn_shed(s, pick[i]);
    return k;
}

// Releases every connection evhttp has freed (one pass over the table).
static void conns_release_freed(pd_http_server *s) {
    int64_t now = pd_time_us();
    for (int fd = 0; fd < s->n_conn_slots; fd++) {
        http_conn *c = &s->conns[fd];
        if (c->bev && bev_is_freed(c->bev) && !gate_lingers(c->gate, now)) conn_release(s, c);
    }
}

static void conns_sweep(pd_http_server *s, int64_t now) {
    conns_resolve(s);
    for (int fd = 0; fd < s->n_conn_slots; fd++) {
        http_conn *c = &s->conns[fd];
        if (!c->bev) continue;
        if (bev_is_freed(c->bev)) {
            if (!gate_lingers(c->gate, now)) conn_release(s, c);
            continue;
        }
        if (c->n_busy > 0 || c->is_shed) continue;
        bool has_input = evbuffer_get_length(bufferevent_get_input(c->bev)) > 0;
        if (has_input && !c->t_input_us) c->t_input_us = now;
        if (!has_input && !c->t_input_us && now - c->t_idle_us > s->keepalive_timeout_us) conn_shed(s, c);
        else if (c->t_input_us && now - c->t_input_us > s->header_timeout_us) conn_shed(s, c);
    }
}

static void on_sweep(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    conns_sweep(arg, pd_time_us());
}

static void on_kick(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    conns_resolve(arg);  // refused connections get their fd now, and are shut down
}

static struct bufferevent *on_new_conn(struct event_base *base, void *arg) {
    pd_http_server *s = arg;
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (!bev) return NULL;  // evhttp makes its own (uncounted; only on OOM)
    if (PD_ARRAY_RESERVE(s->pending, s->cap_pending, (size_t)s->n_pending + 1) != PD_OK)
        return bev;  // uncounted; evhttp owns it alone
    conns_resolve(s);
    conns_release_shed(s);
    // Over the limit (connections being closed by us do not count: their fds go at the next sweep):
    // close a batch of the longest-idle ones; with none idle, refuse this one.
    if (s->n_conns - s->n_shedding + 1 > s->max_connections) conns_release_freed(s);  // closed by their clients
    bool refuse = s->n_conns - s->n_shedding + 1 > s->max_connections && conns_shed_idle(s, shed_batch(s)) == 0;
    bufferevent_incref(bev);
    s->pending[s->n_pending++] = (http_pending){bev, gate_new(s, bev), refuse};
    s->backoff_ms = 0;  // accept() works again
    s->n_conns++;
    // evhttp sets the fd when we return; a refused connection is shut down right after
    if (refuse) event_active(s->kick, EV_TIMEOUT, 0);
    return bev;
}

// The listener's error callback gets the listener's user data, which evhttp owns (its struct
// evhttp): servers are found by listener in this registry instead.
static pthread_mutex_t g_servers_mu = PTHREAD_MUTEX_INITIALIZER;
static pd_http_server *g_servers;  // linked through next_server

static void registry_add(pd_http_server *s) {
    pthread_mutex_lock(&g_servers_mu);
    s->next_server = g_servers;
    g_servers = s;
    pthread_mutex_unlock(&g_servers_mu);
}

static void registry_remove(pd_http_server *s) {
    pthread_mutex_lock(&g_servers_mu);
    for (pd_http_server **p = &g_servers; *p; p = &(*p)->next_server)
        if (*p == s) {
            *p = s->next_server;
            break;
        }
    pthread_mutex_unlock(&g_servers_mu);
}

static pd_http_server *registry_find(const struct evconnlistener *l) {
    pthread_mutex_lock(&g_servers_mu);
    pd_http_server *s = g_servers;
    while (s && s->listener != l) s = s->next_server;
    pthread_mutex_unlock(&g_servers_mu);
    return s;
}

// accept() failed for a reason other than EAGAIN / ECONNABORTED (which libevent retries itself).
static void on_accept_error(struct evconnlistener *l, void *arg) {
    PD_UNUSED(arg);  // evhttp's
    pd_http_server *s = registry_find(l);
    if (!s) {
        evconnlistener_disable(l);  // cannot happen; never spin
        return;
    }
    int e = EVUTIL_SOCKET_ERROR();
    int64_t now = pd_time_us();
    s->n_emfile++;
    evconnlistener_disable(l);
    conns_resolve(s);
    conns_release_shed(s);
    int n = conns_shed_idle(s, shed_batch(s));
    // The limit was above what the descriptors allow: bring it below the connections open now,
    // so that from here on the limit (closing idle connections per accept) acts before accept()
    // fails.
    int lim = PD_MAX(16, s->n_conns - s->n_shedding - HTTP_SHED_BATCH);
    bool lowered = lim < s->max_connections;
    if (lowered) s->max_connections = lim;
    if (now - s->t_last_emfile_log_us >= 10 * 1000000) {
        PD_LOG_W("http: accept() failed: %s (%lld time(s) since the last report); pausing accepts, "
                 "closed %d idle connection(s); %d open; connection limit now %d", evutil_socket_error_to_string(e),
                 (long long)(s->n_emfile - s->n_emfile_logged), n, s->n_conns, s->max_connections);
        s->t_last_emfile_log_us = now;
        s->n_emfile_logged = s->n_emfile;
    }
    // back off: 10 ms, doubling while accept keeps failing, at most 1 s
    s->backoff_ms = s->backoff_ms ? PD_MIN(1000, s->backoff_ms * 2) : 10;
    struct timeval tv = {s->backoff_ms / 1000, (s->backoff_ms % 1000) * 1000};
    event_add(s->resume, &tv);
}

static void on_resume(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    pd_http_server *s = arg;
    conns_resolve(s);
    conns_release_shed(s);
    if (s->listener) evconnlistener_enable(s->listener);
}

// Marks r's connection busy / idle (requests held by handlers are never shed).
static void conn_note_busy(pd_http_server *s, struct evhttp_connection *evcon, bool busy) {
    struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return;
    if (fd >= s->n_conn_slots || s->conns[fd].bev != bev) conns_resolve(s);
    if (fd >= s->n_conn_slots || s->conns[fd].bev != bev) return;
    http_conn *c = &s->conns[fd];
    if (busy) {
        c->n_busy++;
    } else if (c->n_busy > 0) {
        c->n_busy--;
        c->t_idle_us = pd_time_us();
        c->t_input_us = 0;
    }
}

static pd_status conns_init(pd_http_server *s, const pd_http_params *p, pd_err *err) {
    // Like nginx's worker_rlimit_nofile: use the hard limit on descriptors, and keep a reserve
    // below it for upstream connections, files and the engine.
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
        (void)getrlimit(RLIMIT_NOFILE, &rl);
    }
    long lim = rl.rlim_cur == RLIM_INFINITY ? 1L << 20 : (long)rl.rlim_cur;
    long reserve = PD_MAX(64L, lim / 8);
    long autolim = PD_MAX(16L, lim - reserve);
    s->max_connections = p->max_connections > 0 ? p->max_connections : (int)PD_MIN(autolim, 1L << 20);
    s->header_timeout_us = (int64_t)(p->header_timeout_s > 0 ? p->header_timeout_s : 60) * 1000000;
    s->keepalive_timeout_us = (int64_t)(p->keepalive_timeout_s > 0 ? p->keepalive_timeout_s : 30) * 1000000;
    s->listener = evhttp_bound_socket_get_listener(s->sock);
    s->sweep = event_new(s->base, -1, EV_PERSIST, on_sweep, s);
    s->resume = event_new(s->base, -1, 0, on_resume, s);
    s->kick = event_new(s->base, -1, 0, on_kick, s);
    if (!s->sweep || !s->resume || !s->kick) {
        pd_err_set(err, PD_ERR_NOMEM, "http: out of memory");
        return PD_ERR_NOMEM;
    }
    struct timeval tv = {0, 500 * 1000};
    event_add(s->sweep, &tv);
    if (s->listener) {
        registry_add(s);
        evconnlistener_set_error_cb(s->listener, on_accept_error);
    }
    return PD_OK;
}

static void conns_fini(pd_http_server *s) {
    registry_remove(s);
    if (s->sweep) event_free(s->sweep);
    if (s->resume) event_free(s->resume);
    if (s->kick) event_free(s->kick);
    for (int i = 0; i < s->n_pending; i++) {
        gate_free(s->pending[i].gate);
        bufferevent_decref(s->pending[i].bev);
    }
    for (int fd = 0; fd < s->n_conn_slots; fd++)
        if (s->conns[fd].bev) {
            gate_free(s->conns[fd].gate);
            bufferevent_decref(s->conns[fd].bev);
        }
    pd_free(s->pending);
    pd_free(s->conns);
    pd_free(s->shed_fds);
}

int pd_http_server_n_connections(const pd_http_server *s) { return s->n_conns; }
int pd_http_server_max_connections(const pd_http_server *s) { return s->max_connections; }

// ---- server ------------------------------------------------------------------------------------

// Listens with a deep accept queue (net.core.somaxconn; evhttp's own bind and libevent's default
// use 128, so a connection storm left clients in SYN retransmits, or "connected" ones the server
// never saw, for seconds) and hands the listener to evhttp.
static struct evhttp_bound_socket *bind_listener(pd_http_server *s, const char *host, int port) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    if (getaddrinfo(host, ps, &hints, &ai) != 0 || !ai) return NULL;
    struct evconnlistener *l = NULL;
    for (struct addrinfo *a = ai; a && !l; a = a->ai_next)
        l = evconnlistener_new_bind(s->base, NULL, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC,
                                    65535 /* the kernel caps it at net.core.somaxconn */, a->ai_addr,
                                    (int)a->ai_addrlen);
    freeaddrinfo(ai);
    if (!l) return NULL;
    struct evhttp_bound_socket *b = evhttp_bind_listener(s->http, l);
    if (!b) evconnlistener_free(l);
    return b;
}

pd_http_server *pd_http_server_new(struct event_base *base, const pd_http_params *p, pd_err *err) {
    pd_http_params d = pd_http_params_default();
    if (!p) p = &d;
    if (!base || p->port < 0 || p->port > 65535 || p->max_body_bytes == 0) {
        pd_err_set(err, PD_ERR_INVALID, "http: bad server parameters");
        return NULL;
    }
    pd_http_server *s = pd_calloc(1, sizeof *s);
    if (!s) {
        pd_err_set(err, PD_ERR_NOMEM, "http: out of memory");
        return NULL;
    }
    s->base = base;
    s->max_body_bytes = p->max_body_bytes;
    s->on_response = p->on_response;
    s->on_response_ud = p->on_response_ud;
    s->http = evhttp_new(base);
    if (!s->http) {
        pd_err_set(err, PD_ERR_NOMEM, "http: evhttp_new failed");
        goto fail;
    }
    // evhttp stops reading a body at the limit; its 413 becomes JSON in the error gate
    evhttp_set_max_body_size(s->http, (ev_ssize_t)PD_MIN(s->max_body_bytes, (size_t)INT64_MAX));
    evhttp_set_max_headers_size(s->http, HTTP_MAX_HEADERS);  // request line + headers
    evhttp_set_timeout(s->http, p->timeout_s > 0 ? p->timeout_s : 60);
    evhttp_set_bevcb(s->http, on_new_conn, s);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(s->http, on_request, s);
    const char *host = p->host && *p->host ? p->host : "127.0.0.1";
    s->sock = bind_listener(s, host, p->port);
    if (!s->sock) {
        pd_err_set(err, PD_ERR_IO, "http: cannot listen on %s:%d", host, p->port);
        goto fail;
    }
    struct sockaddr_storage ss;
    ev_socklen_t sl = sizeof ss;
    if (getsockname(evhttp_bound_socket_get_fd(s->sock), (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6) s->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    if (conns_init(s, p, err) != PD_OK) goto fail;
    return s;
fail:
    pd_http_server_free(s);
    return NULL;
}

void pd_http_server_free(pd_http_server *s) {
    if (!s) return;
    // Tell holders their requests are gone, then detach so evhttp_free's connection teardown
    // does not call back into freed wrappers.
    while (s->active) {
        pd_http_req *r = s->active;
        if (r->close_fn) r->close_fn(r, r->close_ud);
        req_end(r);
    }
    if (s->http) evhttp_free(s->http);  // runs on_flush_close for tracked connections
    pd_free(s->flushing);
    conns_fini(s);
    for (int i = 0; i < s->n_routes; i++) {
        pd_free(s->routes[i].method);
        pd_free(s->routes[i].path);
    }
    pd_free(s);
}

int pd_http_server_port(const pd_http_server *s) { return s->port; }

int pd_http_server_n_active(const pd_http_server *s) { return s->n_active; }

void pd_http_server_drain(pd_http_server *s, int retry_after_s) {
    s->is_draining = true;
    s->retry_after_s = retry_after_s > 0 ? retry_after_s : 1;
}

bool pd_http_server_is_draining(const pd_http_server *s) { return s->is_draining; }

void pd_http_server_end_all(pd_http_server *s, const char *msg) {
    while (s->active) {
        pd_http_req *r = s->active;
        if (r->evcon) evhttp_connection_set_closecb(r->evcon, NULL, NULL);
        if (r->ev) {
            json_t *e = pd_http_error_body("server_error", msg, NULL, "shutdown");
            if (r->is_streaming) {
                if (e) pd_http_sse_send_json(r, e);
                s->n_writing++;
                evhttp_send_reply_end(r->ev);  // no [DONE]: the stream is incomplete
                s->n_writing--;
            } else {
                char *txt = e ? json_dumps(e, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
                struct evbuffer *buf = evbuffer_new();
                if (buf) evbuffer_add_printf(buf, "%s", txt ? txt : "{}");
                char ra[16];
                snprintf(ra, sizeof ra, "%d", s->retry_after_s > 0 ? s->retry_after_s : 1);
                struct evkeyvalq *h = evhttp_request_get_output_headers(r->ev);
                evhttp_add_header(h, "Content-Type", "application/json");
                evhttp_add_header(h, "Retry-After", ra);
                evhttp_add_header(h, "Connection", "close");
                s->n_writing++;
                evhttp_send_reply(r->ev, 503, pd_http_status_reason(503), buf);
                s->n_writing--;
                if (buf) evbuffer_free(buf);
                free(txt);
                note_status(s, 503);
            }
            json_decref(e);
            r->ev = NULL;  // ended: the holder's close callback must not reply on it
        }
        if (r->close_fn) r->close_fn(r, r->close_ud);
        req_end(r);
    }
}

int pd_http_server_n_unflushed(pd_http_server *s) {
    int n = 0;
    for (int i = 0; i < s->n_flushing; i++) {
        struct bufferevent *bev = evhttp_connection_get_bufferevent(s->flushing[i]);
        n += bev && evbuffer_get_length(bufferevent_get_output(bev)) > 0;
    }
    return n;
}

void pd_http_server_stop_accepting(pd_http_server *s) {
    if (s->sock) {
        evhttp_del_accept_socket(s->http, s->sock);
        s->sock = NULL;
        s->listener = NULL;  // freed with the bound socket
    }
}

pd_status pd_http_server_route(pd_http_server *s, const char *method, const char *path,
                               pd_http_handler_fn fn, void *ud) {
    if (s->n_routes >= PD_HTTP_MAX_ROUTES || !method || !path || !fn) return PD_ERR_INVALID;
    for (int i = 0; i < s->n_routes; i++)
        if (!strcmp(s->routes[i].method, method) && !strcmp(s->routes[i].path, path))
            return PD_ERR_INVALID;
    route *rt = &s->routes[s->n_routes];
    rt->method = pd_strdup(method);
    rt->path = pd_strdup(path);
    if (!rt->method || !rt->path) {
        pd_free(rt->method);
        pd_free(rt->path);
        return PD_ERR_NOMEM;
    }
    rt->fn = fn;
    rt->ud = ud;
    s->n_routes++;
    return PD_OK;
}
