// http — a thin HTTP/1.1 server layer over libevent's evhttp: listen on host:port, dispatch by a
// route table, bound request bodies, reply with JSON (and OpenAI-shaped error bodies), stream
// Server-Sent Events, and tell the handler when the client went away.
//
// Threads: everything runs on the thread that runs the event_base passed to pd_http_server_new
// (one event loop for all connections: an idle or streaming connection costs a socket and a few
// buffers, never a thread). None of these functions is thread-safe; call them from that thread.
//
// Request lifecycle:
//   the loop reads a whole request ─► route lookup ─► handler(r, ud)
//     unknown path ─► 404, known path + other method ─► 405 (with Allow), body over
//     max_body_bytes ─► 413; all three with an OpenAI-shaped JSON error body, handled here.
//   The handler either replies at once (pd_http_reply*, which ends r) or keeps r and replies later
//   from another callback on the same loop (async; e.g. when the engine has produced tokens).
//   Streaming: pd_http_sse_begin, then any number of pd_http_sse_send, then pd_http_sse_end (ends
//   r).
//   If the client closes the connection while the handler still holds r, the close callback set
//   with pd_http_req_set_close_cb runs once; r is freed right after it returns and must not be
//   used again. A handler that holds r must therefore set a close callback.
//
// Body limit: bodies up to max_body_bytes reach the handler; bigger ones get a JSON 413, with or
// without Content-Length (chunked). libevent stops reading a body at the limit, so a huge upload
// cannot exhaust memory; what the client still sends after the refusal is read and discarded
// (lingering close) so that it reads the reply.
// The request line and headers are limited to 64 KiB (more: a JSON 400).
// Every error libevent 2.1 answers by itself (400 malformed request or headers too large, 413,
// 417 unsupported Expect, 501 unknown method) is rewritten into the same OpenAI-shaped JSON error
// ("error": {"message", "type", "param", "code"}) with its status and "Connection: close" (see
// "the error gate" in server.c). Timeouts close the connection without a reply.
//
// Connections (like nginx): the server raises its RLIMIT_NOFILE soft limit to the hard one and,
// unless max_connections says otherwise, allows that limit minus an eighth (at least 64) in
// reserve for everything else. At the limit it closes the longest-idle keep-alive connections (32
// at a time, or a sixteenth of the limit if smaller) so that new clients still get in; with none idle the new connection is closed. Idle
// connections close after keepalive_timeout_s; a request not complete header_timeout_s after its
// first bytes closes its connection. When accept() fails for lack of descriptors (EMFILE, ENFILE)
// or memory, accepting pauses (100 ms doubling to 1 s) and one warning per 10 s is logged.
//
// Ownership: pd_http_req objects are owned by this layer; a handler borrows r from the handler
// call until it ends r (a reply) or the close callback returns. Strings returned by accessors are
// valid as long as r.
#pragma once

#include <jansson.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

struct event_base;
struct evbuffer;

typedef struct pd_http_server pd_http_server;
typedef struct pd_http_req pd_http_req;

typedef void (*pd_http_handler_fn)(pd_http_req *r, void *ud);
typedef void (*pd_http_close_fn)(pd_http_req *r, void *ud);
// Called once per response with its status code (for metrics).
typedef void (*pd_http_response_fn)(int status, void *ud);

typedef struct pd_http_params {
    const char *host;          // address to bind (default "127.0.0.1"); borrowed for the call
    int port;                  // 0 = any free port (see pd_http_server_port)
    size_t max_body_bytes;     // default 8 MiB
    int timeout_s;             // libevent's per-read / per-write inactivity timeout (default 60)
    int header_timeout_s;      // a request must arrive whole this long after its first bytes (60)
    int keepalive_timeout_s;   // an idle keep-alive connection is closed after this (default 30)
    int max_connections;       // open connections at most; 0 = from RLIMIT_NOFILE (see below)
    pd_http_response_fn on_response;  // optional
    void *on_response_ud;
} pd_http_params;
pd_http_params pd_http_params_default(void);

// Binds and starts listening on base (borrowed; must outlive the server).
// NULL with err: PD_ERR_IO (bind/listen failed, err names host:port), PD_ERR_INVALID, PD_ERR_NOMEM.
pd_http_server *pd_http_server_new(struct event_base *base, const pd_http_params *p, pd_err *err);
// Closes the listener and every connection (requests still held get their close callback first).
// NULL is a no-op.
void pd_http_server_free(pd_http_server *s);
// The port actually bound (useful with port 0).
int pd_http_server_port(const pd_http_server *s);
// Stops accepting new connections; existing ones keep going (graceful shutdown).
void pd_http_server_stop_accepting(pd_http_server *s);
// Number of requests handed to handlers and not yet ended.
int pd_http_server_n_active(const pd_http_server *s);
// Connections open now, and the limit in force.
int pd_http_server_n_connections(const pd_http_server *s);
int pd_http_server_max_connections(const pd_http_server *s);

// ---- graceful shutdown ---------------------------------------------------------------------------
// Drain mode (the first step of a graceful shutdown; nothing is closed):
//   * GET and HEAD requests still reach their handlers (health, metrics, state pages are read-only;
//     a handler asks pd_http_server_is_draining to answer /health with 503 "draining");
//   * every other request (POST: new work) gets 503 + Retry-After: retry_after_s with an OpenAI
//     error body (type "server_error", code "draining"), without reaching its handler;
//   * every response from now on carries "Connection: close", so keep-alive clients reconnect
//     elsewhere; requests already held by handlers (streams) continue untouched.
void pd_http_server_drain(pd_http_server *s, int retry_after_s);
bool pd_http_server_is_draining(const pd_http_server *s);
// Ends every request still held by a handler (the drain deadline passed): a stream gets a last
// SSE event with an OpenAI error object (type "server_error", code "shutdown", message msg) and its
// chunked reply is ended WITHOUT "data: [DONE]" (so clients can tell it is incomplete); a request
// not yet answered gets 503 + Retry-After with the same error. Then each holder's close callback
// runs (as if the client had gone away: it must release what it holds and forget r).
void pd_http_server_end_all(pd_http_server *s, const char *msg);
// Connections of requests ended while draining whose reply bytes are not yet all written to the
// socket. A caller that is about to free the server waits for 0 (bounded) so the last chunks and
// "[DONE]" reach the clients: pd_http_server_free closes sockets without flushing.
int pd_http_server_n_unflushed(pd_http_server *s);

// Adds a route: exact path match (the query string is ignored), method "GET", "POST", ...
// PD_OK, PD_ERR_INVALID (duplicate or too many routes) or PD_ERR_NOMEM.
pd_status pd_http_server_route(pd_http_server *s, const char *method, const char *path,
                               pd_http_handler_fn fn, void *ud);

// ---- request accessors -------------------------------------------------------------------------
const char *pd_http_req_method(const pd_http_req *r);  // "GET", "POST", ...
const char *pd_http_req_path(const pd_http_req *r);    // without the query string
// The body, contiguous; *len excludes the terminating NUL that is always there. Never NULL.
const char *pd_http_req_body(pd_http_req *r, size_t *len);
// A request header (case-insensitive name), or NULL.
const char *pd_http_req_header(const pd_http_req *r, const char *name);
// A query-string parameter ("since" of /x?since=4), URL-decoded, or NULL.
const char *pd_http_req_query(pd_http_req *r, const char *name);
// Sets the callback that runs if the client disconnects before r is ended (see lifecycle above).
void pd_http_req_set_close_cb(pd_http_req *r, pd_http_close_fn fn, void *ud);
// Bytes queued on r's connection and not yet written to the socket (slow-client backpressure).
size_t pd_http_req_n_pending_bytes(const pd_http_req *r);

// ---- replies (each of these ends r) ------------------------------------------------------------
// Adds a response header; call before the reply / pd_http_sse_begin.
void pd_http_reply_header(pd_http_req *r, const char *name, const char *value);
void pd_http_reply(pd_http_req *r, int status, const char *content_type, const char *body,
                   size_t len);
// Serialises obj compactly (borrowed) as application/json.
void pd_http_reply_json(pd_http_req *r, int status, json_t *obj);
// Replies with pd_http_error_body(type, message, param, code).
void pd_http_reply_error(pd_http_req *r, int status, const char *type, const char *message,
                         const char *param, const char *code);

// ---- Server-Sent Events ------------------------------------------------------------------------
// Starts a 200 text/event-stream chunked reply.
void pd_http_sse_begin(pd_http_req *r);
// Sends one event "data: <data>\n\n" (a multi-line data is sent as several data: lines).
void pd_http_sse_send(pd_http_req *r, const char *data, size_t len);
// Serialises obj compactly (borrowed) and sends it as one event.
void pd_http_sse_send_json(pd_http_req *r, json_t *obj);
// Sends "data: [DONE]\n\n" if send_done, then ends the chunked reply (ends r).
void pd_http_sse_end(pd_http_req *r, bool send_done);

// ---- pure helpers (no connection; unit-tested) --------------------------------------------------
// Appends the SSE framing of one event to out: every line of data becomes "data: <line>\n",
// then one blank line. Returns 0, or -1 on allocation failure.
int pd_http_sse_frame(struct evbuffer *out, const char *data, size_t len);
// The OpenAI error object {"error": {"message", "type", "param", "code"}}; param and code may be
// NULL (JSON null). New reference owned by the caller (json_decref); NULL on OOM.
json_t *pd_http_error_body(const char *type, const char *message, const char *param,
                           const char *code);
// The standard reason phrase of an HTTP status ("Not Found"); "Unknown" if not known.
const char *pd_http_status_reason(int status);

#ifdef __cplusplus
}
#endif
