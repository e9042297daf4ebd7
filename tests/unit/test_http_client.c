// test_http_client.c — pd_http_client: the incremental SSE reader fed at every split point, and
// live requests against the house server (pd_http_server on 127.0.0.1, port 0) on one event loop:
// JSON replies, streams delivered as they are produced, many concurrent calls through a small
// pool, request timeouts, cancels (also from inside a callback), refused connections, bad URLs.
// A watchdog timer bounds every loop; nothing sleeps. pd_http_fetch (blocking) runs against a
// server whose loop runs on a second thread.
#include "test.h"

#include <event2/event.h>
#include <event2/thread.h>
#include <pthread.h>

#include "http/client.h"
#include "http/http.h"

// ---- SSE reader ----------------------------------------------------------------------------------

typedef struct sse_log {
    char text[2048];  // "event|data\n" per event
    int n;
} sse_log;

static void log_event(const char *event, const char *data, size_t len, void *ud) {
    sse_log *l = ud;
    size_t k = strlen(l->text);
    snprintf(l->text + k, sizeof l->text - k, "%s|%.*s\n", event, (int)len, data);
    PD_CHECK(data[len] == 0);
    l->n++;
}

// Feeds `in` split at `cut` (and byte by byte when cut < 0), returns the log.
static void feed_split(const char *in, long cut, sse_log *l) {
    pd_http_client_sse s;
    pd_http_client_sse_init(&s, 0);
    memset(l, 0, sizeof *l);
    size_t n = strlen(in);
    if (cut < 0) {
        for (size_t i = 0; i < n; i++) PD_CHECK_EQ(pd_http_client_sse_feed(&s, in + i, 1, log_event, l), PD_OK);
    } else {
        PD_CHECK_EQ(pd_http_client_sse_feed(&s, in, (size_t)cut, log_event, l), PD_OK);
        PD_CHECK_EQ(pd_http_client_sse_feed(&s, in + cut, n - (size_t)cut, log_event, l), PD_OK);
    }
    pd_http_client_sse_fini(&s);
}

PD_TEST(sse_reader_every_split) {
    const char *in = "data: {\"a\":1}\n\n"
                     ": a comment\r\n"
                     "event: ping\r\ndata: x\r\n\r\n"
                     "data:no-space\rdata:  two\r\r"
                     "id: 7\nretry: 10\ndata\n\n"
                     "data: [DONE]\n\n"
                     "data: dropped (no blank line)";
    const char *want = "|{\"a\":1}\n"
                       "ping|x\n"
                       "|no-space\n two\n"
                       "|\n"
                       "|[DONE]\n";
    sse_log l;
    for (long cut = -1; cut <= (long)strlen(in); cut++) {
        feed_split(in, cut, &l);
        PD_CHECK_MSG(!strcmp(l.text, want), "cut %ld: got\n%s", cut, l.text);
        if (strcmp(l.text, want)) break;
    }
    PD_CHECK_EQ(l.n, 5);
}

PD_TEST(sse_reader_limits) {
    pd_http_client_sse s;
    pd_http_client_sse_init(&s, 8);
    sse_log l = {0};
    PD_CHECK_EQ(pd_http_client_sse_feed(&s, "data: 12\n\n", 10, log_event, &l), PD_OK);
    PD_CHECK_EQ(l.n, 1);
    PD_CHECK_EQ(pd_http_client_sse_feed(&s, "data: 123456789", 15, log_event, &l), PD_ERR_PROTO);
    pd_http_client_sse_fini(&s);
    pd_http_client_sse_fini(&s);  // zeroed: no-op
    pd_http_client_sse_init(&s, 8);  // an event over the limit through many short lines
    PD_CHECK_EQ(pd_http_client_sse_feed(&s, "data:1234\ndata:5678\n", 20, log_event, &l), PD_ERR_PROTO);
    pd_http_client_sse_fini(&s);
}

// ---- a live server -------------------------------------------------------------------------------

typedef struct stream_state {
    pd_http_req *r;
    struct event *ev;
    int n_sent;
} stream_state;

static void on_stream_close(pd_http_req *r, void *ud) {
    stream_state *st = ud;
    event_free(st->ev);
    pd_free(st);
}

static void on_stream_tick(evutil_socket_t fd, short what, void *arg) {
    stream_state *st = arg;
    char msg[64];
    int n = snprintf(msg, sizeof msg, "{\"i\":%d}", st->n_sent++);
    pd_http_sse_send(st->r, msg, (size_t)n);
    if (st->n_sent == 5) {
        pd_http_req_set_close_cb(st->r, NULL, NULL);
        pd_http_sse_end(st->r, true);
        event_free(st->ev);
        pd_free(st);
        return;
    }
    struct timeval tv = {0, 10000};
    evtimer_add(st->ev, &tv);
}

// /stream: five events 10 ms apart, then [DONE].
static void h_stream(pd_http_req *r, void *ud) {
    struct event_base *base = ud;
    stream_state *st = pd_calloc(1, sizeof *st);
    st->r = r;
    st->ev = evtimer_new(base, on_stream_tick, st);
    pd_http_req_set_close_cb(r, on_stream_close, st);
    pd_http_sse_begin(r);
    struct timeval tv = {0, 10000};
    evtimer_add(st->ev, &tv);
}

static void h_json(pd_http_req *r, void *ud) {
    size_t len;
    const char *body = pd_http_req_body(r, &len);
    json_t *o = json_pack("{s:s,s:I}", "method", pd_http_req_method(r), "body_len", (json_int_t)len);
    if (len) json_object_set_new(o, "body", json_stringn(body, len));
    const char *h = pd_http_req_header(r, "X-Test");
    if (h) json_object_set_new(o, "x_test", json_string(h));
    pd_http_reply_json(r, 200, o);
    json_decref(o);
}

static void on_hold_close(pd_http_req *r, void *ud) { (*(int *)ud)++; }

// /hold: never answers (until the client goes away).
static int g_n_hold_closed;
static void h_hold(pd_http_req *r, void *ud) { pd_http_req_set_close_cb(r, on_hold_close, &g_n_hold_closed); }

typedef struct fixture {
    struct event_base *base;
    pd_http_server *srv;
    pd_http_client *cli;
    struct event *watchdog;
    char url[128];
} fixture;

static void on_watchdog(evutil_socket_t fd, short what, void *arg) {
    PD_FAIL_("watchdog: the loop ran for 5 s");
    event_base_loopbreak(arg);
}

static bool fixture_init(fixture *f, int max_connections, int request_timeout_ms) {
    memset(f, 0, sizeof *f);
    f->base = event_base_new();
    pd_http_params hp = pd_http_params_default();
    hp.port = 0;
    pd_err err = {0};
    f->srv = pd_http_server_new(f->base, &hp, &err);
    if (!f->srv) return false;
    pd_http_server_route(f->srv, "GET", "/stream", h_stream, f->base);
    pd_http_server_route(f->srv, "POST", "/json", h_json, NULL);
    pd_http_server_route(f->srv, "GET", "/hold", h_hold, NULL);
    snprintf(f->url, sizeof f->url, "http://127.0.0.1:%d", pd_http_server_port(f->srv));
    pd_http_client_params cp = pd_http_client_params_default();
    cp.max_connections = max_connections;
    cp.request_timeout_ms = request_timeout_ms;
    f->cli = pd_http_client_new(f->base, &cp, &err);
    f->watchdog = evtimer_new(f->base, on_watchdog, f->base);
    struct timeval tv = {5, 0};
    evtimer_add(f->watchdog, &tv);
    return f->cli != NULL;
}

static void fixture_fini(fixture *f) {
    pd_http_client_free(f->cli);
    pd_http_server_free(f->srv);
    if (f->watchdog) event_free(f->watchdog);
    event_base_free(f->base);
}

typedef struct outcome {
    fixture *f;
    int n_done, n_expected;  // the loop stops when n_done reaches n_expected
    pd_status status;
    int http_status, n_headers, n_events;
    char body[1024];
    size_t body_len;
    int64_t t_event_us[8];
    int64_t t_done_us;
    char msg[128];
    bool cancel_in_sse;
    char content_type[64];
} outcome;

static void o_headers(pd_http_client_call *c, int status, void *ud) {
    outcome *o = ud;
    o->n_headers++;
    const char *ct = pd_http_client_call_header(c, "Content-Type");
    snprintf(o->content_type, sizeof o->content_type, "%s", ct ? ct : "");
}
static void o_body(pd_http_client_call *c, const char *data, size_t len, void *ud) {
    outcome *o = ud;
    size_t n = PD_MIN(len, sizeof o->body - 1 - o->body_len);
    memcpy(o->body + o->body_len, data, n);
    o->body_len += n;
}
static void o_done(pd_http_client_call *c, pd_status st, int http_status, const char *msg, void *ud) {
    outcome *o = ud;
    o->status = st;
    o->http_status = http_status;
    o->t_done_us = pd_time_us();
    snprintf(o->msg, sizeof o->msg, "%s", msg);
    if (++o->n_done >= o->n_expected) event_base_loopbreak(o->f->base);
}
static void o_sse(pd_http_client_call *c, const char *event, const char *data, size_t len, void *ud) {
    outcome *o = ud;
    if (o->n_events < 8) o->t_event_us[o->n_events] = pd_time_us();
    o->n_events++;
    if (o->cancel_in_sse && o->n_events == 2) {
        pd_http_client_call_cancel(c);
        o->n_done++;
        event_base_loopbreak(o->f->base);
    }
}

static const pd_http_client_callbacks CB = {.on_headers = o_headers, .on_body = o_body, .on_sse = o_sse,
                                            .on_done = o_done};

PD_TEST(client_json_roundtrip) {
    fixture f;
    PD_REQUIRE(fixture_init(&f, 4, 0));
    outcome o = {.f = &f, .n_expected = 1};
    char url[160];
    snprintf(url, sizeof url, "%s/json?x=1", f.url);
    const char *headers[] = {"X-Test", "yes", NULL};
    pd_http_client_request rq = {.method = "POST", .url = url, .headers = headers, .body = "{\"k\":2}", .body_len = 7};
    pd_err err = {0};
    PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &o, &err) != NULL);
    PD_CHECK_EQ(o.n_done, 0);  // nothing runs inside send
    event_base_dispatch(f.base);
    PD_CHECK_EQ(o.status, PD_OK);
    PD_CHECK_EQ(o.http_status, 200);
    PD_CHECK_EQ(o.n_headers, 1);
    PD_CHECK_CONTAINS(o.content_type, "application/json");
    PD_CHECK_CONTAINS(o.body, "\"method\":\"POST\"");
    PD_CHECK_CONTAINS(o.body, "\"body\":\"{\\\"k\\\":2}\"");
    PD_CHECK_CONTAINS(o.body, "\"x_test\":\"yes\"");
    PD_CHECK_EQ(pd_http_client_n_active(f.cli), 0);
    fixture_fini(&f);
}

PD_TEST(client_stream_arrives_incrementally) {
    fixture f;
    PD_REQUIRE(fixture_init(&f, 4, 0));
    outcome o = {.f = &f, .n_expected = 1};
    char url[160];
    snprintf(url, sizeof url, "%s/stream", f.url);
    pd_http_client_request rq = {.url = url};
    PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &o, NULL) != NULL);
    event_base_dispatch(f.base);
    PD_CHECK_EQ(o.status, PD_OK);
    PD_CHECK_EQ(o.n_events, 6);  // five JSON events and [DONE]
    // Events were handed over as they came (10 ms apart), not at the end of the body.
    PD_CHECK(o.t_event_us[4] - o.t_event_us[0] >= 30000);
    PD_CHECK(o.t_done_us >= o.t_event_us[4]);
    PD_CHECK_CONTAINS(o.body, "data: {\"i\":4}");
    fixture_fini(&f);
}

PD_TEST(client_many_calls_small_pool) {
    fixture f;
    PD_REQUIRE(fixture_init(&f, 3, 0));
    enum { N = 24 };
    outcome o[N];
    int n_done_total = 0;
    char url[160];
    snprintf(url, sizeof url, "%s/stream", f.url);
    pd_http_client_request rq = {.url = url};
    for (int i = 0; i < N; i++) {
        o[i] = (outcome){.f = &f, .n_expected = 1 << 30};
        PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &o[i], NULL) != NULL);
    }
    PD_CHECK_EQ(pd_http_client_n_active(f.cli), N);
    while (pd_http_client_n_active(f.cli) > 0 && !pd_test_failed_) {
        event_base_loop(f.base, EVLOOP_ONCE);
        PD_CHECK(pd_http_client_n_connections(f.cli) <= 3);
    }
    for (int i = 0; i < N; i++) {
        n_done_total += o[i].n_done;
        PD_CHECK_EQ(o[i].status, PD_OK);
        PD_CHECK_EQ(o[i].n_events, 6);
    }
    PD_CHECK_EQ(n_done_total, N);
    fixture_fini(&f);
}

PD_TEST(client_timeout_cancel_refused) {
    fixture f;
    PD_REQUIRE(fixture_init(&f, 4, 100));
    char url[160];
    g_n_hold_closed = 0;
    // 1. request timeout: the server holds the request; the client gives up after 100 ms.
    outcome o = {.f = &f, .n_expected = 1};
    snprintf(url, sizeof url, "%s/hold", f.url);
    pd_http_client_request rq = {.url = url};
    int64_t t0 = pd_time_us();
    PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &o, NULL) != NULL);
    event_base_dispatch(f.base);
    PD_CHECK_EQ(o.status, PD_ERR_TIMEOUT);
    PD_CHECK(pd_time_us() - t0 >= 90000);
    PD_CHECK_CONTAINS(o.msg, "timeout");
    // The server notices the disconnect.
    while (g_n_hold_closed == 0 && !pd_test_failed_) event_base_loop(f.base, EVLOOP_ONCE);
    PD_CHECK_EQ(g_n_hold_closed, 1);

    // 2. cancel from inside on_sse: no on_done afterwards.
    outcome c = {.f = &f, .n_expected = 1, .cancel_in_sse = true};
    snprintf(url, sizeof url, "%s/stream", f.url);
    PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &c, NULL) != NULL);
    event_base_dispatch(f.base);
    while (pd_http_client_n_active(f.cli) > 0 && !pd_test_failed_) event_base_loop(f.base, EVLOOP_ONCE);
    PD_CHECK_EQ(c.n_events, 2);
    PD_CHECK_EQ(c.t_done_us, 0);

    // 3. cancel from outside, while queued: nothing runs.
    outcome q = {.f = &f, .n_expected = 1};
    pd_http_client_call *call = pd_http_client_send(f.cli, &rq, &CB, &q, NULL);
    PD_REQUIRE(call != NULL);
    pd_http_client_call_cancel(call);
    PD_CHECK_EQ(pd_http_client_n_active(f.cli), 0);
    event_base_loop(f.base, EVLOOP_NONBLOCK);
    PD_CHECK_EQ(q.n_done, 0);

    // 4. connection refused (a port nobody listens on: the server's, after it is gone).
    pd_http_server_free(f.srv);
    f.srv = NULL;
    outcome r = {.f = &f, .n_expected = 1};
    PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &r, NULL) != NULL);
    event_base_dispatch(f.base);
    PD_CHECK_EQ(r.status, PD_ERR_IO);
    PD_CHECK_EQ(r.http_status, 0);

    // 5. bad URLs fail at once.
    pd_err err = {0};
    pd_http_client_request bad = {.url = "ftp://x/"};
    PD_CHECK(pd_http_client_send(f.cli, &bad, &CB, &r, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    bad.url = "https://example.com/";
    PD_CHECK(pd_http_client_send(f.cli, &bad, &CB, &r, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_UNSUPPORTED);
    bad.url = "not a url";
    PD_CHECK(pd_http_client_send(f.cli, &bad, &CB, &r, &err) == NULL);
    fixture_fini(&f);
}

static void *loop_thread(void *base) {
    event_base_dispatch(base);
    return NULL;
}

// pd_http_fetch: a JSON reply, a non-200 status (still a response), a refused connection.
PD_TEST(fetch_blocking) {
    PD_REQUIRE(evthread_use_pthreads() == 0);  // before the base: loopbreak from this thread
    fixture f;
    PD_REQUIRE(fixture_init(&f, 4, 0));
    pthread_t th;
    PD_REQUIRE(pthread_create(&th, NULL, loop_thread, f.base) == 0);
    char url[160];
    snprintf(url, sizeof url, "%s/json", f.url);
    pd_http_client_request rq = {.method = "POST", .url = url, .body = "{\"k\":2}", .body_len = 7};
    int http = 0;
    char *body = NULL;
    size_t blen = 0;
    pd_err err = {0};
    PD_CHECK_EQ(pd_http_fetch(&rq, 2000, &http, &body, &blen, &err), PD_OK);
    PD_CHECK_EQ(http, 200);
    PD_REQUIRE(body);
    PD_CHECK_CONTAINS(body, "\"method\":\"POST\"");
    PD_CHECK_CONTAINS(body, "\"body\":\"{\\\"k\\\":2}\"");
    PD_CHECK_EQ(blen, strlen(body));
    pd_free(body);
    pd_http_client_request nf = {.url = url};  // a path with no route
    snprintf(url, sizeof url, "%s/no-such-path", f.url);
    PD_CHECK_EQ(pd_http_fetch(&nf, 2000, &http, &body, NULL, &err), PD_OK);
    PD_CHECK_EQ(http, 404);
    pd_free(body);
    event_base_loopbreak(f.base);
    pthread_join(th, NULL);
    pd_http_server_free(f.srv);  // now nobody listens on that port
    f.srv = NULL;
    PD_CHECK_EQ(pd_http_fetch(&nf, 2000, &http, &body, NULL, &err), PD_ERR_IO);
    PD_CHECK(body == NULL);
    PD_CHECK(err.msg[0] != 0);
    fixture_fini(&f);
}

PD_TEST(client_free_ends_calls_in_flight) {
    fixture f;
    PD_REQUIRE(fixture_init(&f, 2, 0));
    char url[160];
    snprintf(url, sizeof url, "%s/hold", f.url);
    pd_http_client_request rq = {.url = url};
    outcome o[3];
    for (int i = 0; i < 3; i++) {
        o[i] = (outcome){.f = &f, .n_expected = 1 << 30};
        PD_REQUIRE(pd_http_client_send(f.cli, &rq, &CB, &o[i], NULL) != NULL);
    }
    for (int i = 0; i < 20; i++) event_base_loop(f.base, EVLOOP_NONBLOCK);  // two on the wire, one queued
    pd_http_client_free(f.cli);
    for (int i = 0; i < 3; i++) {
        PD_CHECK_EQ(o[i].n_done, 1);
        PD_CHECK_EQ(o[i].status, PD_ERR_CLOSED);
    }
    f.cli = NULL;
    fixture_fini(&f);
}
