// run.c — pd_bench_run: the load generator. One event loop on the calling thread drives a
// pd_http_client; every request is a streaming completion whose SSE chunks are timed as they
// arrive.
//
//   arrival timer ──► due requests ──► (closed loop: wait for a concurrency slot) ──► send
//        ▲                                                                            │
//        └── re-armed for the next arrival        on_sse: time content chunks, usage ─┤
//                                                 on_done: record, free a slot ◄──────┘
//   deadline timer (timeout_s): cancel what is in flight, mark the rest unsent, stop.
//
// Open loop: requests go out at their scheduled arrival whatever the server's state, so a slow
// server shows up as growing latency instead of a lower offered rate (no coordinated omission);
// the clock of a request starts at its arrival even if it then waits for a pooled connection.
// Closed loop (max_concurrency): the clock starts when a slot frees up and the request is sent,
// as in vLLM's semaphore.
//
// Timestamps are pd_time_us() taken inside the callbacks. Bytes that arrive together (one read)
// carry one timestamp, so an ITL of ~0 means the server flushed several chunks at once.
#include <event2/event.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "http/client.h"

typedef struct bench_run bench_run;

typedef struct bench_req {
    bench_run *run;
    int idx;
    pd_http_client_call *call;  // while in flight
    int64_t t_send_us, t_last_us;
    int n_chunks;
    double *itl_ms;             // owned (moved into the record)
    int n_itl;
    size_t itl_cap;
    int usage_prompt, usage_completion;
    char *stream_error;         // owned: an error object seen in the stream
    char err_body[512];         // start of a non-200 body
    size_t err_body_len;
    bool is_sent, is_done;
} bench_req;

struct bench_run {
    const pd_bench_params *p;
    const pd_bench_dataset *ds;
    struct event_base *base;
    pd_http_client *client;
    char *url;                  // owned: base_url + endpoint
    const char *model;
    bench_req *reqs;            // owned: ds->n
    double *arrival_s;          // owned: ds->n
    int *waiting;               // owned: FIFO of due requests waiting for a slot
    int w_head, w_tail;
    int next_arrival, n_in_flight, n_done, n_sent, n_failed;
    int64_t t0_us, t_end_us;
    struct event *ev_arrival, *ev_deadline, *ev_progress;
    const char *headers[5];     // name/value pairs for every request, NULL-terminated
    char auth[512];             // "Bearer <key>"
    pd_bench_record *records;   // borrowed from the result
    bool is_stopping;
};

pd_bench_params pd_bench_params_default(void) {
    return (pd_bench_params){
        .endpoint = "/v1/completions",
        .request_rate = INFINITY,
        .burstiness = 1.0,
        .request_timeout_s = 600,
        .timeout_s = 3600,
        .progress_interval_s = 5,
    };
}

void pd_bench_result_free(pd_bench_result *r) {
    if (!r) return;
    for (int i = 0; r->records && i < r->n_records; i++) {
        pd_free(r->records[i].error);
        pd_free(r->records[i].itl_ms);
    }
    pd_free(r->records);
    pd_free(r->model);
    pd_free(r);
}

// ---- one request ---------------------------------------------------------------------------------

static char *dup_printf(const char *fmt, const char *a, const char *b) {
    size_t n = strlen(fmt) + strlen(a) + strlen(b) + 1;
    char *s = pd_malloc(n);
    if (s) snprintf(s, n, fmt, a, b);
    return s;
}

// The JSON body of request q. out: owned by caller (pd_free); NULL on OOM.
static char *request_body(bench_run *run, const pd_bench_prompt *q) {
    json_t *o = json_object();
    if (!o) return NULL;
    bool ok = true;
    if (run->model) ok &= !json_object_set_new(o, "model", json_string(run->model));
    json_t *prompt = NULL;
    char *text = NULL;
    if (run->p->is_chat) {
        text = q->text ? q->text : pd_bench_dataset_ids_to_text(q->ids, q->n_ids);
        prompt = json_pack("[{s:s,s:s}]", "role", "user", "content", text ? text : "");
        ok &= !json_object_set_new(o, "messages", prompt);
    } else if (q->text) {
        ok &= !json_object_set_new(o, "prompt", json_string(q->text));
    } else {
        prompt = json_array();
        for (int i = 0; prompt && i < q->n_ids; i++) ok &= !json_array_append_new(prompt, json_integer(q->ids[i]));
        ok &= !json_object_set_new(o, "prompt", prompt);
    }
    if (text && text != q->text) pd_free(text);
    ok &= !json_object_set_new(o, "max_tokens", json_integer(q->n_output));
    ok &= !json_object_set_new(o, "ignore_eos", json_true());
    ok &= !json_object_set_new(o, "stream", json_true());
    ok &= !json_object_set_new(o, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (run->p->return_token_ids) ok &= !json_object_set_new(o, "return_token_ids", json_true());
    char *js = ok ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!js) return NULL;
    char *out = pd_strdup(js);  // json_dumps uses malloc; hand back pd_malloc'ed memory
    free(js);
    return out;
}

static bool itl_push(bench_req *rq, double v) {
    if (PD_ARRAY_RESERVE(rq->itl_ms, rq->itl_cap, (size_t)rq->n_itl + 1) != PD_OK) return false;
    rq->itl_ms[rq->n_itl++] = v;
    return true;
}

// Tokens a chunk carries by id (choices[0].token_ids, with return_token_ids), else 0.
static size_t chunk_n_ids(json_t *o) {
    json_t *ids = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "token_ids");
    return json_is_array(ids) ? json_array_size(ids) : 0;
}

// The text a chunk carries: choices[0].text (completions) or choices[0].delta.content (chat).
static const char *chunk_text(json_t *o) {
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    if (!c) return NULL;
    json_t *t = json_object_get(c, "text");
    if (!json_is_string(t)) t = json_object_get(json_object_get(c, "delta"), "content");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static void on_sse(pd_http_client_call *call, const char *event, const char *data, size_t len, void *ud) {
    bench_req *rq = ud;
    int64_t now = pd_time_us();
    if (len == 6 && !memcmp(data, "[DONE]", 6)) return;
    json_t *o = json_loadb(data, len, 0, NULL);
    if (!o) return;
    json_t *err = json_object_get(o, "error");
    if (err && !json_is_null(err) && !rq->stream_error) {
        json_t *m = json_object_get(err, "message");
        rq->stream_error = pd_strdup(json_is_string(m) ? json_string_value(m) : "error event in the stream");
    }
    const char *text = chunk_text(o);
    // With token ids, a chunk is a token iff it carries ids (held-back text can come out later in
    // a chunk of its own); without, iff it carries text.
    bool is_token = rq->run->p->return_token_ids ? chunk_n_ids(o) > 0 : text && *text;
    if (is_token) {
        if (rq->n_chunks == 0) rq->run->records[rq->idx].ttft_ms = (double)(now - rq->t_send_us) / 1000.0;
        else itl_push(rq, (double)(now - rq->t_last_us) / 1000.0);
        rq->t_last_us = now;
        rq->n_chunks++;
    }
    json_t *usage = json_object_get(o, "usage");
    if (json_is_object(usage)) {
        json_t *ct = json_object_get(usage, "completion_tokens"), *pt = json_object_get(usage, "prompt_tokens");
        if (json_is_integer(ct)) rq->usage_completion = (int)json_integer_value(ct);
        if (json_is_integer(pt)) rq->usage_prompt = (int)json_integer_value(pt);
    }
    json_decref(o);
}

static void on_body(pd_http_client_call *call, const char *data, size_t len, void *ud) {
    bench_req *rq = ud;
    if (rq->err_body_len + 1 >= sizeof rq->err_body) return;
    // Keep the start of the body in case it turns out to be an error reply (cheap: 512 bytes).
    size_t n = PD_MIN(len, sizeof rq->err_body - 1 - rq->err_body_len);
    memcpy(rq->err_body + rq->err_body_len, data, n);
    rq->err_body_len += n;
    rq->err_body[rq->err_body_len] = 0;
}

static void send_next_waiting(bench_run *run);

// Fills the record of rq from what was seen; frees the request's buffers.
static void record_finish(bench_req *rq, pd_status st, int http_status, const char *msg, int64_t now) {
    bench_run *run = rq->run;
    pd_bench_record *r = &run->records[rq->idx];
    const pd_bench_prompt *q = &run->ds->prompts[rq->idx];
    r->http_status = http_status;
    r->e2e_ms = (double)(now - rq->t_send_us) / 1000.0;
    r->n_chunks = rq->n_chunks;
    r->n_output_tokens = rq->usage_completion > 0 ? rq->usage_completion : rq->n_chunks;
    r->n_prompt_tokens = rq->usage_prompt > 0 ? rq->usage_prompt : q->n_ids;
    r->itl_ms = rq->itl_ms;
    r->n_itl = rq->n_itl;
    rq->itl_ms = NULL;
    char buf[700];
    if (st != PD_OK) snprintf(buf, sizeof buf, "%s: %s", pd_status_str(st), msg);
    else if (http_status != 200) snprintf(buf, sizeof buf, "HTTP %d: %s", http_status, rq->err_body);
    else if (rq->stream_error) snprintf(buf, sizeof buf, "error in stream: %s", rq->stream_error);
    else if (rq->n_chunks == 0) snprintf(buf, sizeof buf, "no content in the response");
    else buf[0] = 0;
    r->is_ok = buf[0] == 0;
    if (!r->is_ok) {
        r->error = pd_strdup(buf);
        r->ttft_ms = NAN;
    }
    r->tpot_ms = r->is_ok ? pd_bench_stats_tpot(r->ttft_ms, r->e2e_ms, r->n_output_tokens) : NAN;
    pd_free(rq->stream_error);
    rq->stream_error = NULL;
    rq->is_done = true;
}

static void on_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg, void *ud) {
    bench_req *rq = ud;
    bench_run *run = rq->run;
    int64_t now = pd_time_us();
    rq->call = NULL;
    record_finish(rq, st, http_status, msg, now);
    run->n_in_flight--;
    run->n_done++;
    run->n_failed += !run->records[rq->idx].is_ok;
    run->t_end_us = now;
    if (run->n_done == run->ds->n) {
        event_base_loopbreak(run->base);
        return;
    }
    send_next_waiting(run);
}

static void req_send(bench_run *run, int idx) {
    bench_req *rq = &run->reqs[idx];
    pd_bench_record *r = &run->records[idx];
    char *body = request_body(run, &run->ds->prompts[idx]);
    rq->is_sent = true;
    rq->t_send_us = pd_time_us();
    r->start_s = (double)(rq->t_send_us - run->t0_us) / 1e6;
    run->n_in_flight++;
    run->n_sent++;
    pd_err err = {0};
    if (body) {
        pd_http_client_request hr = {.method = "POST", .url = run->url, .headers = run->headers,
                                     .body = body, .body_len = strlen(body)};
        pd_http_client_callbacks cb = {.on_body = on_body, .on_sse = on_sse, .on_done = on_done};
        rq->call = pd_http_client_send(run->client, &hr, &cb, rq, &err);
        pd_free(body);
    } else {
        pd_err_set(&err, PD_ERR_NOMEM, "out of memory building the request");
    }
    if (!rq->call) on_done(NULL, err.status ? err.status : PD_ERR_NOMEM, 0, err.msg, rq);
}

static void send_next_waiting(bench_run *run) {
    while (!run->is_stopping && run->w_head < run->w_tail &&
           (run->p->max_concurrency <= 0 || run->n_in_flight < run->p->max_concurrency))
        req_send(run, run->waiting[run->w_head++]);
}

// ---- schedule ------------------------------------------------------------------------------------

static void on_arrival(evutil_socket_t fd, short what, void *arg) {
    bench_run *run = arg;
    int64_t now = pd_time_us();
    int n = run->ds->n;
    while (run->next_arrival < n && run->t0_us + (int64_t)(run->arrival_s[run->next_arrival] * 1e6) <= now) {
        run->waiting[run->w_tail++] = run->next_arrival++;
        send_next_waiting(run);
        if (run->is_stopping) return;
    }
    if (run->next_arrival < n) {
        int64_t due = run->t0_us + (int64_t)(run->arrival_s[run->next_arrival] * 1e6) - pd_time_us();
        if (due < 0) due = 0;
        struct timeval tv = {(time_t)(due / 1000000), (suseconds_t)(due % 1000000)};
        evtimer_add(run->ev_arrival, &tv);
    }
}

static void on_deadline(evutil_socket_t fd, short what, void *arg) {
    bench_run *run = arg;
    run->is_stopping = true;
    int64_t now = pd_time_us();
    for (int i = 0; i < run->ds->n; i++) {
        bench_req *rq = &run->reqs[i];
        if (rq->is_done) continue;
        if (rq->call) {
            pd_http_client_call_cancel(rq->call);
            rq->call = NULL;
            record_finish(rq, PD_ERR_TIMEOUT, 0, "benchmark timeout (--timeout-s): cancelled in flight", now);
        } else {
            rq->t_send_us = now;
            record_finish(rq, PD_ERR_TIMEOUT, 0, "benchmark timeout (--timeout-s): never sent", now);
            run->records[i].start_s = NAN;
            run->records[i].e2e_ms = NAN;
        }
    }
    run->t_end_us = now;
    event_base_loopbreak(run->base);
}

// ---- model discovery ---------------------------------------------------------------------------

// GET base_url/v1/models and return data[0].id. out: owned by caller (pd_free).
static pd_status discover_model(bench_run *run, char **out, pd_err *err) {
    char *url = dup_printf("%s%s", run->p->base_url, "/v1/models");
    if (!url) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    pd_http_client_request hr = {.method = "GET", .url = url, .headers = run->p->api_key ? run->headers + 2 : NULL};
    double rt_ms = run->p->request_timeout_s > 0 ? PD_MIN(run->p->request_timeout_s * 1000.0, 2e9) : 0;
    int http = 0;
    char *body = NULL;
    pd_err e = {0};
    pd_status st = pd_http_fetch(&hr, (int)rt_ms, &http, &body, NULL, &e);
    if (st) {
        st = pd_err_set(err, PD_ERR_IO, "GET %s failed: %s", url, e.msg);
    } else if (http != 200) {
        st = pd_err_set(err, PD_ERR_IO, "GET %s failed: HTTP %d", url, http);
    } else {
        json_t *o = json_loads(body, 0, NULL);
        json_t *id = json_object_get(json_array_get(json_object_get(o, "data"), 0), "id");
        if (json_is_string(id)) *out = pd_strdup(json_string_value(id));
        else st = pd_err_set(err, PD_ERR_IO, "GET %s: no model in the reply (pass --model)", url);
        if (!st && !*out) st = pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        json_decref(o);
    }
    pd_free(body);
    pd_free(url);
    return st;
}

// ---- progress and warmup -------------------------------------------------------------------------

static struct timeval tv_of(double s) {
    s = PD_MIN(PD_MAX(s, 0), 1e8);
    return (struct timeval){(time_t)s, (suseconds_t)((s - floor(s)) * 1e6)};
}

static void on_progress_tick(evutil_socket_t fd, short what, void *arg) {
    bench_run *run = arg;
    pd_bench_progress pr = {.elapsed_s = (double)(pd_time_us() - run->t0_us) / 1e6, .n_total = run->ds->n,
                            .n_sent = run->n_sent, .n_in_flight = run->n_in_flight, .n_done = run->n_done,
                            .n_failed = run->n_failed};
    run->p->on_progress(&pr, run->p->progress_ud);
}

typedef struct warmup {
    bench_run *run;
    int n_left, n_failed;
} warmup;

static void warmup_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg, void *ud) {
    warmup *w = ud;
    w->n_failed += st != PD_OK || http_status != 200;
    if (--w->n_left == 0) event_base_loopbreak(w->run->base);
}

// Sends n_warmup requests (prompts taken in order) at once and waits for all; the pool and the
// per-request timeout bound them. Their results are dropped.
static void run_warmup(bench_run *run) {
    warmup w = {.run = run};
    pd_http_client_callbacks cb = {.on_done = warmup_done};
    for (int i = 0; i < run->p->n_warmup; i++) {
        char *body = request_body(run, &run->ds->prompts[i % run->ds->n]);
        if (!body) break;
        pd_http_client_request hr = {.method = "POST", .url = run->url, .headers = run->headers, .body = body,
                                     .body_len = strlen(body)};
        w.n_left += pd_http_client_send(run->client, &hr, &cb, &w, NULL) != NULL;
        pd_free(body);
    }
    if (w.n_left > 0) event_base_dispatch(run->base);
    if (w.n_failed) PD_LOG_W("bench: %d of %d warmup requests failed", w.n_failed, run->p->n_warmup);
}

// ---- the run -------------------------------------------------------------------------------------

static pd_status run_setup(bench_run *run, pd_bench_result *res, pd_err *err) {
    const pd_bench_params *p = run->p;
    int n = run->ds->n;
    run->base = event_base_new();
    if (!run->base) return pd_err_set(err, PD_ERR_NOMEM, "cannot create an event loop");
    pd_http_client_params cp = pd_http_client_params_default();
    cp.max_connections = p->max_connections > 0 ? p->max_connections
                         : p->max_concurrency > 0 ? PD_MIN(p->max_concurrency, 4096) : 256;
    double rt_ms = p->request_timeout_s > 0 ? p->request_timeout_s * 1000.0 : 0;
    cp.request_timeout_ms = rt_ms > 2e9 ? 2000000000 : (int)rt_ms;
    cp.read_timeout_ms = cp.request_timeout_ms > 0 ? cp.request_timeout_ms : cp.read_timeout_ms;
    pd_err e = {0};
    if (!(run->client = pd_http_client_new(run->base, &cp, &e))) return pd_err_set(err, e.status, "%s", e.msg);
    if (!(run->url = dup_printf("%s%s", p->base_url, p->endpoint))) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    run->reqs = pd_calloc((size_t)n, sizeof *run->reqs);
    run->arrival_s = pd_calloc((size_t)n, sizeof *run->arrival_s);
    run->waiting = pd_calloc((size_t)n, sizeof *run->waiting);
    res->records = pd_calloc((size_t)n, sizeof *res->records);
    run->ev_arrival = evtimer_new(run->base, on_arrival, run);
    run->ev_deadline = evtimer_new(run->base, on_deadline, run);
    if (!run->reqs || !run->arrival_s || !run->waiting || !res->records || !run->ev_arrival || !run->ev_deadline)
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    res->n_records = n;
    run->records = res->records;
    // Accept first: discovery sends only the Authorization pair (headers + 2).
    int k = 0;
    run->headers[k++] = "Accept", run->headers[k++] = "text/event-stream";
    if (p->api_key) {
        snprintf(run->auth, sizeof run->auth, "Bearer %s", p->api_key);
        run->headers[k++] = "Authorization", run->headers[k++] = run->auth;
    }
    run->headers[k] = NULL;
    if (p->on_progress && p->progress_interval_s > 0 &&
        !(run->ev_progress = event_new(run->base, -1, EV_PERSIST, on_progress_tick, run)))
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        run->reqs[i].run = run;
        run->reqs[i].idx = i;
        res->records[i] = (pd_bench_record){.idx = i, .ttft_ms = NAN, .tpot_ms = NAN, .e2e_ms = NAN};
        res->records[i].n_prompt_tokens = run->ds->prompts[i].n_ids;
    }
    if (run->ds->has_arrivals)
        for (int i = 0; i < n; i++) run->arrival_s[i] = run->ds->prompts[i].arrival_s;
    else
        pd_bench_dataset_arrivals(n, p->request_rate, p->burstiness, p->seed, run->arrival_s);
    return PD_OK;
}

static void run_cleanup(bench_run *run) {
    if (run->reqs)
        for (int i = 0; i < run->ds->n; i++) {
            pd_free(run->reqs[i].itl_ms);
            pd_free(run->reqs[i].stream_error);
        }
    pd_http_client_free(run->client);  // nothing is in flight any more; a no-op safety net
    if (run->ev_arrival) event_free(run->ev_arrival);
    if (run->ev_deadline) event_free(run->ev_deadline);
    if (run->ev_progress) event_free(run->ev_progress);
    if (run->base) event_base_free(run->base);
    pd_free(run->url);
    pd_free(run->reqs);
    pd_free(run->arrival_s);
    pd_free(run->waiting);
}

pd_status pd_bench_run(const pd_bench_params *p0, const pd_bench_dataset *ds, pd_bench_result **out,
                       pd_err *err) {
    *out = NULL;
    if (!p0 || !p0->base_url || !p0->endpoint || !ds || ds->n < 1)
        return pd_err_set(err, PD_ERR_INVALID, "bench: url, endpoint and a non-empty dataset are required");
    if (strncmp(p0->base_url, "http://", 7))
        return pd_err_set(err, PD_ERR_INVALID, "bench: --url must start with http:// (got '%s')", p0->base_url);
    pd_bench_params p = *p0;
    p.is_chat = strstr(p.endpoint, "chat") != NULL;
    bench_run run = {.p = &p, .ds = ds};
    pd_bench_result *res = pd_calloc(1, sizeof *res);
    pd_status st = res ? run_setup(&run, res, err) : pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    if (st) goto fail;
    res->request_rate = p.request_rate > 0 ? p.request_rate : INFINITY;
    res->burstiness = p.burstiness;
    res->max_concurrency = p.max_concurrency;
    if (p.model) res->model = pd_strdup(p.model);
    else if ((st = discover_model(&run, &res->model, err))) goto fail;
    if (!res->model) {
        st = pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    run.model = res->model;
    if (p.n_warmup > 0) run_warmup(&run);
    run.t0_us = run.t_end_us = pd_time_us();
    struct timeval zero = {0, 0};
    evtimer_add(run.ev_arrival, &zero);
    if (p.timeout_s > 0) {
        struct timeval tv = tv_of(p.timeout_s);
        evtimer_add(run.ev_deadline, &tv);
    }
    if (run.ev_progress) {
        struct timeval tv = tv_of(p.progress_interval_s);
        event_add(run.ev_progress, &tv);
    }
    event_base_dispatch(run.base);
    double duration_s = (double)(run.t_end_us - run.t0_us) / 1e6;
    if ((st = pd_bench_stats_compute(res->records, (size_t)res->n_records, duration_s, &p.slo, &res->metrics))) {
        pd_err_set(err, st, "out of memory computing statistics");
        goto fail;
    }
    if (p.on_progress) {
        pd_bench_progress pr = {.elapsed_s = duration_s, .n_total = ds->n, .n_sent = run.n_sent, .n_done = ds->n,
                                .n_failed = res->metrics.n_failed, .is_final = true};
        p.on_progress(&pr, p.progress_ud);
    }
    run_cleanup(&run);
    *out = res;
    return PD_OK;
fail:
    run_cleanup(&run);
    pd_bench_result_free(res);
    return st;
}
