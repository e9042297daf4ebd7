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
#include "http/http.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <stdio.h>
#include <string.h>

#define PD_HTTP_MAX_ROUTES 64

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
    bool is_draining;         // pd_http_server_drain: POSTs get 503, replies close the connection
    int retry_after_s;
    // While draining: connections whose request ended, until libevent frees them (their close
    // callback is on_flush_close) or a new request on them gets a wrapper (see flush_untrack).
    struct evhttp_connection **flushing;
    int n_flushing, cap_flushing;
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
    p.timeout_s = 600;
    return p;
}

// ---- wrapper lifecycle -------------------------------------------------------------------------

static void on_conn_close(struct evhttp_connection *evcon, void *arg);

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
    if (s->n_flushing == s->cap_flushing) {
        int nc = s->cap_flushing ? 2 * s->cap_flushing : 64;
        struct evhttp_connection **t = pd_realloc(s->flushing, sizeof *t * (size_t)nc);
        if (!t) return;
        s->flushing = t;
        s->cap_flushing = nc;
    }
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
    return r;
}

// Unlinks and frees the wrapper; detaches it from its connection first.
static void req_end(pd_http_req *r) {
    pd_http_server *s = r->srv;
    if (s->in_handler == r) s->in_handler = NULL;
    if (r->watch) event_free(r->watch);
    if (r->has_query) evhttp_clear_headers(&r->query);
    if (r->evcon) evhttp_connection_set_closecb(r->evcon, NULL, NULL);
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
    r->evcon = NULL;  // being freed by libevent: nothing to detach
    r->ev = NULL;
    if (r->close_fn) r->close_fn(r, r->close_ud);
    req_end(r);
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
        evhttp_send_reply(ev, status, pd_http_status_reason(status), buf);
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
    evhttp_send_reply_start(r->ev, 200, "OK");
    note_status(r->srv, 200);
}

void pd_http_sse_send(pd_http_req *r, const char *data, size_t len) {
    if (!r->ev) return;
    struct evbuffer *buf = evbuffer_new();
    if (!buf) return;
    if (pd_http_sse_frame(buf, data, len) == 0) evhttp_send_reply_chunk(r->ev, buf);
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
        evhttp_send_reply_end(r->ev);
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
    evhttp_send_reply(ev, status, pd_http_status_reason(status), buf);
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
        reply_raw_error(s, ev, 413, msg, NULL);
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

// ---- server ------------------------------------------------------------------------------------

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
    size_t hard = s->max_body_bytes > ((size_t)1 << 40) ? s->max_body_bytes
                                                          : 2 * s->max_body_bytes + (64u << 10);
    evhttp_set_max_body_size(s->http, (ev_ssize_t)hard);
    evhttp_set_max_headers_size(s->http, 64 << 10);  // request line + headers
    evhttp_set_timeout(s->http, p->timeout_s > 0 ? p->timeout_s : 600);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(s->http, on_request, s);
    const char *host = p->host && *p->host ? p->host : "127.0.0.1";
    s->sock = evhttp_bind_socket_with_handle(s->http, host, (ev_uint16_t)p->port);
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
                evhttp_send_reply_end(r->ev);  // no [DONE]: the stream is incomplete
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
                evhttp_send_reply(r->ev, 503, pd_http_status_reason(503), buf);
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
