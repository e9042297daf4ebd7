// http/client — an asynchronous HTTP/1.1 client over libevent's evhttp: many concurrent requests
// on one event-loop thread, response bodies delivered as they arrive, and Server-Sent Events
// parsed incrementally (the `data:` lines of an OpenAI stream). Used by `pdserve bench` to load a
// server and by the router to proxy streams; pd_http_fetch wraps it for one blocking request
// (`pdserve run`'s start-up probes, bench's model discovery).
//
// Model:
//   pd_http_client  a pool of at most max_connections keep-alive connections (evhttp_connection),
//                   each carrying one request at a time. A request that finds no free connection
//                   waits in a FIFO inside the client and is sent when one frees up; its timers
//                   (request_timeout_ms) start when pd_http_client_send is called, so queueing time
//                   is part of its latency.
//   pd_http_client_call  one request in flight. Created by pd_http_client_send, ended by exactly
//                   one on_done callback, or silently by pd_http_client_call_cancel.
//
// Callback order for one call (all on the loop thread, never from inside pd_http_client_send):
//   on_headers (once, when the status line and headers are in)
//   ─► on_body / on_sse (zero or more times, as bytes arrive)
//   ─► on_done (exactly once, unless the call was cancelled first)
// on_done's status: PD_OK when a complete response was read (whatever its HTTP status: look at
// http_status), PD_ERR_TIMEOUT (connect/read idle timeout or request_timeout_ms), PD_ERR_IO
// (connection refused, reset, closed mid-body), PD_ERR_PROTO (malformed response, or an SSE line
// longer than max_sse_event_bytes), PD_ERR_CLOSED (the client was freed: see pd_http_client_free).
//
// Re-entrancy: any callback may call pd_http_client_send (new calls) and
// pd_http_client_call_cancel (on any call, its own included); no further callback of a cancelled
// call runs. The call handle is freed right after on_done returns or inside cancel.
//
// SSE: when on_sse is set the body is parsed as text/event-stream (whatever the Content-Type,
// so a server that mislabels its stream still works): lines end in \n, \r\n or \r; `data:` lines
// of one event are joined with \n; `event:` sets the event name; comments (`:`) and `id:`/`retry:`
// are ignored; a blank line dispatches the event. An event still open when the body ends is
// dropped, as the spec says.
//
// Threads: not thread-safe; use one client from the thread that runs its event_base.
// Name resolution: host names are resolved with the blocking getaddrinfo when a connection is
// opened (libevent without an evdns base). Use numeric addresses where a stall would matter.
// TLS (https://) is not supported: PD_ERR_UNSUPPORTED.
#pragma once

#include <stddef.h>

#include "base/base.h"
#include "base/buf.h"

#ifdef __cplusplus
extern "C" {
#endif

struct event_base;

typedef struct pd_http_client pd_http_client;
typedef struct pd_http_client_call pd_http_client_call;

typedef struct pd_http_client_params {
    int max_connections;       // pool size; default 256
    int read_timeout_ms;       // connect timeout and longest silence while a request is in flight;
                               // default 120000
    int request_timeout_ms;    // whole request, from send to on_done; 0 = none (default)
    size_t max_sse_event_bytes;  // longest SSE line / event; default 16 MiB
} pd_http_client_params;
pd_http_client_params pd_http_client_params_default(void);

typedef struct pd_http_client_callbacks {
    // (optional) The status line and headers have arrived (pd_http_client_call_header works from
    // here until on_done).
    void (*on_headers)(pd_http_client_call *call, int http_status, void *ud);
    // (optional) Raw body bytes (after chunked decoding); data is valid during the callback only.
    void (*on_body)(pd_http_client_call *call, const char *data, size_t len, void *ud);
    // (optional) One SSE event. event: the `event:` name or "" (valid during the callback);
    // data: the joined data lines, NUL-terminated at data[len] (valid during the callback).
    void (*on_sse)(pd_http_client_call *call, const char *event, const char *data, size_t len,
                   void *ud);
    // (required) The end of the call, see the status table above. msg: a short human reason
    // ("connection refused", "timeout after 5000 ms"), "" on PD_OK; valid during the callback.
    void (*on_done)(pd_http_client_call *call, pd_status status, int http_status, const char *msg,
                    void *ud);
} pd_http_client_callbacks;

typedef struct pd_http_client_request {
    const char *method;   // "GET", "POST", "PUT", "DELETE"; NULL = "GET"
    const char *url;      // "http://host[:port]/path?query"
    const char *const *headers;  // NULL or name/value pairs ending with NULL ({"Accept", "x", NULL})
    const char *body;     // NULL or body bytes (copied by send)
    size_t body_len;
    const char *content_type;  // default "application/json" when there is a body
} pd_http_client_request;

// base: borrowed, must outlive the client. out: owned by caller (pd_http_client_free); NULL with
// err on PD_ERR_INVALID (bad params) or PD_ERR_NOMEM.
pd_http_client *pd_http_client_new(struct event_base *base, const pd_http_client_params *p,
                                   pd_err *err);
// Ends every call still in flight or queued with on_done(PD_ERR_CLOSED) (on_done may not send
// new requests from there: they fail with PD_ERR_CLOSED too), then closes every connection.
// NULL is a no-op.
void pd_http_client_free(pd_http_client *c);

// Starts a request. cb is copied; ud is passed to every callback. rq and everything it points to
// is copied: it may be freed when send returns.
// Returns the call (owned by the client, valid until on_done returns or it is cancelled), or NULL
// with err: PD_ERR_INVALID (bad URL), PD_ERR_UNSUPPORTED (https), PD_ERR_CLOSED (the client is
// being freed), PD_ERR_NOMEM. No callback runs for a NULL return.
pd_http_client_call *pd_http_client_send(pd_http_client *c, const pd_http_client_request *rq,
                                         const pd_http_client_callbacks *cb, void *ud,
                                         pd_err *err);
// Cancels a call: its connection is closed (the server sees a disconnect) and no callback of it
// runs after this returns. call is freed; safe from inside its own callbacks.
void pd_http_client_call_cancel(pd_http_client_call *call);
// A response header (case-insensitive name), or NULL. Works from on_headers until on_done returns
// (in an on_done that reports an error it may return NULL); the string is borrowed from libevent
// and valid during the current callback.
const char *pd_http_client_call_header(const pd_http_client_call *call, const char *name);
// Calls sent and not yet ended (queued ones included); open connections.
int pd_http_client_n_active(const pd_http_client *c);
int pd_http_client_n_connections(const pd_http_client *c);

// One blocking request on a private event loop (start-up probes and one-off calls from a command,
// not for serving: it blocks the calling thread for up to timeout_ms; <= 0: no limit on the whole
// request, the client's default idle timeout). On PD_OK (a complete
// response, whatever its HTTP status) *http_status is set and *body (owned by the caller,
// pd_free; NUL-terminated, *body_len bytes if body_len is not NULL) holds the response body after
// chunked decoding. Otherwise the client's statuses (PD_ERR_IO for a refused connection,
// PD_ERR_TIMEOUT, ...) with err saying why, and *body NULL.
pd_status pd_http_fetch(const pd_http_client_request *rq, int timeout_ms, int *http_status, char **body,
                        size_t *body_len, pd_err *err);

// ---- the incremental SSE reader (pure; used by the client, exposed for tests and proxies) -------
typedef void (*pd_http_client_sse_fn)(const char *event, const char *data, size_t len, void *ud);
typedef struct pd_http_client_sse {
    pd_buf line;       // the current, not yet terminated line
    pd_buf data;       // data lines of the open event, joined with \n
    char event[64];    // the `event:` field of the open event ("" if none)
    bool has_data;     // a data: line was seen in the open event
    bool last_was_cr;  // the previous byte was \r (so a following \n ends no second line)
    size_t max_bytes;  // longest line / event accepted
} pd_http_client_sse;
// max_bytes: 0 = 16 MiB.
void pd_http_client_sse_init(pd_http_client_sse *s, size_t max_bytes);
void pd_http_client_sse_fini(pd_http_client_sse *s);  // zeroed struct: no-op
// Feeds bytes; fn runs once per complete event, in order. fn may not feed s again.
// PD_OK, PD_ERR_PROTO (a line or event over max_bytes; s must not be fed again) or PD_ERR_NOMEM.
pd_status pd_http_client_sse_feed(pd_http_client_sse *s, const char *buf, size_t len,
                                  pd_http_client_sse_fn fn, void *ud);

#ifdef __cplusplus
}
#endif
