// proxy.c — one client request through the router (an rt_job):
//
//   POST /v1/completions | /v1/chat/completions
//     └─► parse body ─► class (x-priority / API key) ─► rate limit (429) ─► reserved capacity (503)
//          └─► [TOKENIZE] prompt ids: from the body (completions with token ids) or
//              POST <worker>/internal/tokenize; a failure only disables the prefix term
//               └─► DISPATCH: candidates (healthy, not tried, role both|decode) ─► cost / policy
//                   ─► admission: predicted TTFT/TPOT vs the class SLO (503 + Retry-After)
//                    └─► [UPSTREAM] forward the body (+ "priority", + "return_token_ids" when
//                        streaming) and relay the answer:
//                          stream: each SSE event is re-sent at once (never buffered), with the
//                                  token ids recorded and stripped unless the client asked;
//                          otherwise: the worker's status and body, unchanged.
//
// Failover:
//   * transport failure (or a worker 503) before anything reached the client → the same request
//     goes to another worker (at most max_attempts tries in all);
//   * a stream that breaks after chunks were relayed → a continuation: POST /v1/completions on
//     another worker with prompt = prompt ids + generated ids, max_tokens reduced by what was
//     generated, "stream": true. For chat the prompt ids are the chat template's (tokenize takes
//     the chat body) and the completion chunks are converted back to chat.completion.chunk
//     shape. Chunk "id"/"created" keep the first worker's values, so the client sees one stream.
//     Only for single-prompt, n = 1 requests; otherwise the stream ends with an error event.
//     NOTE: a stop string that straddles the break is not matched (the worker's matcher state is
//     lost with it); logprobs continue from the new worker.
//
// Lifetimes: a job owns at most one upstream call. The client going away cancels that call and
// frees the job at once; the upstream finishing ends the client reply and frees the job. Neither
// callback touches the job after it is freed (cancel guarantees no later callback).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "metrics/trace.h"
#include "base/buf.h"
#include "router/router_impl.h"

typedef enum rt_kind { RT_COMPLETIONS = 0, RT_CHAT = 1 } rt_kind;

struct rt_job {
    pd_router *rt;
    rt_job *prev, *next;
    pd_http_req *http;           // NULL once the client is gone
    rt_kind kind;
    json_t *body;                // the client's request (owned)
    bool is_stream, wants_ids, can_continue, is_admitted;
    int class_idx;
    int32_t *prompt_ids;         // owned; (n_prompt)
    int32_t n_prompt;            // ids, or an estimate when !has_ids
    bool has_ids;
    int32_t *gen_ids;            // owned; (n_gen) token ids relayed to the client so far
    int32_t n_gen;
    size_t cap_gen;
    long max_tokens;             // the client's, -1 if absent
    int w;                       // worker of the current upstream call, -1
    int n_attempts;
    uint64_t tried;              // worker slots tried
    int64_t pending_tokens;      // uncached prompt tokens sent with the current attempt
    int64_t queued_at_dispatch;
    int inflight_at_dispatch;
    pd_http_client_call *call;
    bool is_tokenizing, is_continuation;
    int up_status;
    char *buf;                   // owned: a non-streamed body (reply or tokenize)
    size_t len, cap;
    char content_type[64];
    bool sse_started, saw_done, saw_finish, got_chunk;
    bool is_ids_missing;         // text was relayed without token ids: no continuation possible
    char resp_id[96];
    json_int_t created;
    int64_t t_arrival_us, t_first_us, t_last_us, t_dispatch_us;
    int64_t t_first_dispatch_us;  // the first upstream request left (router part of the TTFT)
    bool wants_usage;            // the client's stream_options.include_usage
    bool wants_timings;          // the client's "timings" / stream_options.include_timings
    bool has_breakdown;          // a worker's ttft_breakdown was recorded
    int n_continuations;         // streams continued on another worker (usage is then rewritten)
    bool is_traced;              // tracing on: the router span's ids
    uint8_t trace_id[16], span_id[8], parent_span_id[8];
    bool has_parent_span;
};

static void job_dispatch(rt_job *j);
static void job_tokenize(rt_job *j, int w);
static void on_up_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg,
                       void *ud);

// ---- small helpers ----------------------------------------------------------------------------------
static void buf_append(rt_job *j, const char *data, size_t n) {
    if (n >= SIZE_MAX - j->len || PD_ARRAY_RESERVE(j->buf, j->cap, j->len + n + 1) != PD_OK) return;
    memcpy(j->buf + j->len, data, n);
    j->len += n;
    j->buf[j->len] = 0;
}

static void reply_error(pd_http_req *req, int status, const char *type, const char *msg,
                        const char *code, int retry_after_s) {
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after_s);
        pd_http_reply_header(req, "Retry-After", ra);
    }
    pd_http_reply_error(req, status, type, msg, NULL, code);
}

// s as a JSON string literal (quoted, escaped) into out; "\"\"" when it does not fit.
static void json_str(char *out, size_t cap, const char *s) {
    json_t *v = json_string(s);
    char *q = v ? json_dumps(v, JSON_ENCODE_ANY) : NULL;
    snprintf(out, cap, "%s", q && strlen(q) < cap ? q : "\"\"");
    free(q);  // jansson's allocator
    json_decref(v);
}

static void worker_release(rt_job *j) {
    if (j->w < 0) return;
    rt_worker *w = &j->rt->workers[j->w];
    if (j->is_traced) {  // one span per upstream attempt
        uint8_t s[8];
        char attrs[2 * PD_WIRE_URL_MAX + 64], url[2 * PD_WIRE_URL_MAX];
        json_str(url, sizeof url, w->url);
        snprintf(attrs, sizeof attrs, "\"worker\":%s,\"attempt\":%d,\"tokens_relayed\":%d", url, j->n_attempts,
                 (int)j->n_gen);
        pd_trace_new_span_id(s);
        pd_trace_span(j->trace_id, s, j->span_id, "router.upstream", j->t_dispatch_us, pd_time_us(), attrs);
    }
    if (w->n_inflight > 0) w->n_inflight--;
    j->pending_tokens = 0;
    j->w = -1;
}

static void job_free(rt_job *j) {
    pd_router *r = j->rt;
    if (j->call) pd_http_client_call_cancel(j->call);
    worker_release(j);
    if (r->inflight_by_class[j->class_idx] > 0) r->inflight_by_class[j->class_idx]--;
    pd_metric_set(r->cm[j->class_idx].inflight, r->inflight_by_class[j->class_idx]);
    if (j->prev) j->prev->next = j->next;
    else r->jobs = j->next;
    if (j->next) j->next->prev = j->prev;
    json_decref(j->body);
    pd_free(j->prompt_ids);
    pd_free(j->gen_ids);
    pd_free(j->buf);
    pd_free(j);
}

// Ends the job: records latency (when ok) and frees it. The client reply must be done already.
static void job_end(rt_job *j, bool is_ok) {
    pd_router *r = j->rt;
    if (is_ok) {
        int64_t now = pd_time_us();
        double e2e = (double)(now - j->t_arrival_us) / 1e3;
        double ttft = j->t_first_us ? (double)(j->t_first_us - j->t_arrival_us) / 1e3 : e2e;
        pd_metric_observe(r->cm[j->class_idx].ttft, ttft / 1e3);
        pd_metric_observe(r->cm[j->class_idx].e2e, e2e / 1e3);
        rt_history_note(r, j->class_idx, ttft, e2e, false);
        if (j->t_first_dispatch_us) pd_metric_observe(r->m_ttft_part[0], (double)(j->t_first_dispatch_us - j->t_arrival_us) / 1e6);
    }
    if (j->is_traced) {
        char attrs[256], cls[96];
        json_str(cls, sizeof cls, r->qos.classes[j->class_idx].name);
        snprintf(attrs, sizeof attrs, "\"class\":%s,\"ok\":%s,\"attempts\":%d,\"continuations\":%d", cls,
                 is_ok ? "true" : "false", j->n_attempts, j->n_continuations);
        int64_t now = pd_time_us();
        pd_trace_span(j->trace_id, j->span_id, j->has_parent_span ? j->parent_span_id : NULL, "router.request",
                      j->t_arrival_us, now, attrs);
        uint8_t s[8];
        pd_trace_new_span_id(s);
        pd_trace_span(j->trace_id, s, j->span_id, "router.admission", j->t_arrival_us,
                      j->t_first_dispatch_us ? j->t_first_dispatch_us : now, NULL);
    }
    job_free(j);
}

// Fails the job toward the client: an error reply, or (stream already started) an error event.
static void job_fail(rt_job *j, int status, const char *msg) {
    if (j->http) {
        if (j->sse_started) {
            json_t *e = pd_http_error_body("server_error", msg, NULL, NULL);
            if (e) pd_http_sse_send_json(j->http, e);
            json_decref(e);
            pd_http_sse_end(j->http, true);
        } else {
            reply_error(j->http, status, "server_error", msg, NULL, status == 503 ? 1 : 0);
        }
        j->http = NULL;
    }
    job_end(j, false);
}

static void on_client_close(pd_http_req *req, void *ud) {
    rt_job *j = ud;
    j->http = NULL;
    job_free(j);  // cancels the upstream call: the worker sees the disconnect and aborts
}

// ---- usage and timings ---------------------------------------------------------------------------------
// The router always asks the worker for usage and the TTFT breakdown ("timings": true, and
// stream_options.include_usage for streams) and passes on only what the client asked for. Usage
// is rewritten after a failover, so that the client sees one request's: prompt_tokens = the
// original prompt, completion_tokens = every token the client received (the continuation
// worker counts the relayed tokens as prompt). The first worker's breakdown feeds the router's
// per-part histograms; the client's copy gains router_ms (arrival → first upstream request).
static void fix_usage(rt_job *j, json_t *usage) {
    pd_router *r = j->rt;
    if (j->n_continuations > 0 && j->has_ids) {
        json_object_set_new(usage, "prompt_tokens", json_integer(j->n_prompt));
        json_object_set_new(usage, "completion_tokens", json_integer(j->n_gen));
        json_object_set_new(usage, "total_tokens", json_integer((json_int_t)j->n_prompt + j->n_gen));
    }
    json_t *b = json_object_get(usage, "ttft_breakdown");
    if (json_is_object(b) && !j->has_breakdown && j->n_continuations == 0) {
        j->has_breakdown = true;
        for (int i = 0; i < PD_WIRE_N_TTFT_PARTS; i++) {
            char k[32];
            snprintf(k, sizeof k, "%s_ms", pd_wire_ttft_part_names[i]);
            json_t *v = json_object_get(b, k);
            if (json_is_number(v) && json_number_value(v) >= 0) {
                pd_metric_observe(r->m_ttft_part[i + 1], json_number_value(v) / 1e3);
                rt_ttft_note(r, i + 1, json_number_value(v));
            }
        }
    }
    if (!j->wants_timings) {
        json_object_del(usage, "ttft_breakdown");
    } else if (json_is_object(b)) {
        double router_ms = j->t_first_dispatch_us ? (double)(j->t_first_dispatch_us - j->t_arrival_us) / 1e3 : 0;
        json_object_set_new(b, "router_ms", json_real(router_ms));
        if (j->n_continuations > 0) json_object_set_new(b, "after_failover", json_true());
    }
}

// ---- relaying a stream ---------------------------------------------------------------------------------
// Converts a completions chunk choice to the chat.completion.chunk shape (continuations of chat).
static void to_chat_chunk(json_t *chunk) {
    json_object_set_new(chunk, "object", json_string("chat.completion.chunk"));
    json_t *choices = json_object_get(chunk, "choices");
    size_t i;
    json_t *c;
    json_array_foreach(choices, i, c) {
        json_t *text = json_object_get(c, "text");
        json_t *delta = json_object();
        if (json_is_string(text) && json_string_length(text) > 0)
            json_object_set(delta, "content", text);
        json_object_del(c, "text");
        json_object_set_new(c, "delta", delta);
    }
}

static void relay_event(rt_job *j, const char *data, size_t len) {
    pd_router *r = j->rt;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        j->saw_done = true;
        return;  // sent by pd_http_sse_end once the upstream call is over
    }
    int64_t now = pd_time_us();
    bool is_fresh_first = !j->got_chunk && j->n_gen == 0;  // first chunk of a non-continuation
    json_t *chunk = json_loadb(data, len, 0, NULL);
    if (chunk && json_is_object(chunk)) {
        json_t *u = json_object_get(chunk, "usage");
        json_t *ch = json_object_get(chunk, "choices");
        bool is_usage_only = json_is_object(u) && json_is_array(ch) && json_array_size(ch) == 0;
        if (json_is_object(u)) fix_usage(j, u);
        if (u && !j->wants_usage) json_object_del(chunk, "usage");
        if (is_usage_only) {  // the last chunk: usage alone (not a token; no latency sample)
            if (j->wants_usage && j->http) {
                if (j->resp_id[0]) {
                    json_object_set_new(chunk, "id", json_string(j->resp_id));
                    json_object_set_new(chunk, "created", json_integer(j->created));
                }
                if (j->is_continuation) json_object_set_new(chunk, "object", json_string("chat.completion.chunk"));
                if (!j->sse_started) {
                    pd_http_sse_begin(j->http);
                    j->sse_started = true;
                }
                pd_http_sse_send_json(j->http, chunk);
            }
            json_decref(chunk);
            return;
        }
    }
    if (chunk && json_is_object(chunk) && !json_object_get(chunk, "error")) {
        json_t *c0 = json_array_get(json_object_get(chunk, "choices"), 0);
        json_t *ids = json_object_get(c0, "token_ids");
        size_t k;
        json_t *x;
        json_array_foreach(ids, k, x) {
            if (j->n_gen == INT32_MAX || PD_ARRAY_RESERVE(j->gen_ids, j->cap_gen, (size_t)j->n_gen + 1) != PD_OK) break;
            j->gen_ids[j->n_gen++] = (int32_t)json_integer_value(x);
        }
        if (json_is_string(json_object_get(c0, "finish_reason"))) j->saw_finish = true;
        json_t *text = json_object_get(c0, "text");
        if (!text) text = json_object_get(json_object_get(c0, "delta"), "content");
        if (!ids && json_string_length(text) > 0) j->is_ids_missing = true;
        if (!j->resp_id[0]) {
            snprintf(j->resp_id, sizeof j->resp_id, "%s", json_string_value(json_object_get(chunk, "id")) ? json_string_value(json_object_get(chunk, "id")) : "");
            j->created = json_integer_value(json_object_get(chunk, "created"));
        } else {
            json_object_set_new(chunk, "id", json_string(j->resp_id));
            json_object_set_new(chunk, "created", json_integer(j->created));
        }
        if (j->is_continuation) to_chat_chunk(chunk);
        if (!j->wants_ids) {
            size_t i;
            json_t *c;
            json_array_foreach(json_object_get(chunk, "choices"), i, c) json_object_del(c, "token_ids");
        }
    }
    if (!j->got_chunk) {
        j->got_chunk = true;
        if (!j->t_first_us) j->t_first_us = now;
        j->pending_tokens = 0;
        if (j->w >= 0 && is_fresh_first) {
            rt_worker *w = &r->workers[j->w];
            double per = (double)(now - j->t_dispatch_us) / 1e3 / (j->inflight_at_dispatch + 1);
            w->obs_ttft_per_inflight = w->obs_ttft_per_inflight <= 0 ? per : 0.8 * w->obs_ttft_per_inflight + 0.2 * per;
        }
    } else if (j->t_last_us) {
        double itl_ms = (double)(now - j->t_last_us) / 1e3;
        pd_metric_observe(r->cm[j->class_idx].itl, itl_ms / 1e3);
        if (j->w >= 0) {  // the router's own measure of a step, for workers that report none
            rt_worker *w = &r->workers[j->w];
            bool first = w->obs_step_ms <= 0;
            w->obs_step_ms = first ? itl_ms : 0.9 * w->obs_step_ms + 0.1 * itl_ms;
            w->obs_batch = first ? w->n_inflight : 0.9 * w->obs_batch + 0.1 * w->n_inflight;
        }
    }
    j->t_last_us = now;
    if (!j->http) goto out;
    if (!j->sse_started) {
        pd_http_sse_begin(j->http);
        j->sse_started = true;
    }
    if (chunk) pd_http_sse_send_json(j->http, chunk);
    else pd_http_sse_send(j->http, data, len);
out:
    json_decref(chunk);
}

// ---- upstream callbacks -----------------------------------------------------------------------------
static void on_up_headers(pd_http_client_call *call, int status, void *ud) {
    rt_job *j = ud;
    j->up_status = status;
    const char *ct = pd_http_client_call_header(call, "Content-Type");
    snprintf(j->content_type, sizeof j->content_type, "%s", ct ? ct : "application/json");
}

static void on_up_body(pd_http_client_call *call, const char *data, size_t len, void *ud) {
    rt_job *j = ud;
    if (j->is_tokenizing || !j->is_stream || j->up_status != 200) buf_append(j, data, len);
}

static void on_up_sse(pd_http_client_call *call, const char *event, const char *data, size_t len,
                      void *ud) {
    rt_job *j = ud;
    if (j->is_stream && j->up_status == 200) relay_event(j, data, len);
}

// Builds the continuation body: the original request with prompt = prompt ids + generated ids.
static json_t *continuation_body(rt_job *j) {
    json_t *b = json_deep_copy(j->body);
    json_t *ids = json_array();
    if (!b || !ids) goto fail;
    for (int32_t i = 0; i < j->n_prompt; i++) json_array_append_new(ids, json_integer(j->prompt_ids[i]));
    for (int32_t i = 0; i < j->n_gen; i++) json_array_append_new(ids, json_integer(j->gen_ids[i]));
    json_object_del(b, "messages");
    json_object_del(b, "max_completion_tokens");
    json_object_del(b, "logprobs");
    json_object_del(b, "top_logprobs");
    // Chat-only fields a completions request refuses; a grammar resumes after the generated ids.
    json_object_del(b, "tools");
    json_object_del(b, "tool_choice");
    json_object_del(b, "parallel_tool_calls");
    json_object_del(b, "chat_template_kwargs");
    json_object_set_new(b, "continuation_tokens", json_integer(j->n_gen));
    json_object_set_new(b, "prompt", ids);
    ids = NULL;
    if (j->max_tokens >= 0) json_object_set_new(b, "max_tokens", json_integer(j->max_tokens - j->n_gen));
    return b;
fail:
    json_decref(b);
    json_decref(ids);
    return NULL;
}

static void send_upstream(rt_job *j) {
    pd_router *r = j->rt;
    rt_worker *w = &r->workers[j->w];
    bool cont = j->n_gen > 0;
    json_t *b = cont ? continuation_body(j) : json_deep_copy(j->body);
    if (!b) return job_fail(j, 500, "router: out of memory");
    json_object_set_new(b, "priority", json_integer(r->qos.classes[j->class_idx].priority));
    json_object_set_new(b, "timings", json_true());  // the breakdown feeds the router's histograms
    if (j->is_stream) {
        json_object_set_new(b, "return_token_ids", json_true());
        json_t *so = json_object_get(b, "stream_options");
        if (!json_is_object(so)) {
            so = json_object();
            json_object_set_new(b, "stream_options", so);
        }
        if (so) json_object_set_new(so, "include_usage", json_true());  // usage is rewritten after a failover
    }
    char *txt = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    if (!txt) return job_fail(j, 500, "router: out of memory");
    j->is_continuation = cont && j->kind == RT_CHAT;
    const char *path = cont || j->kind == RT_COMPLETIONS ? "/v1/completions" : "/v1/chat/completions";
    char url[PD_WIRE_URL_MAX + 32];
    snprintf(url, sizeof url, "%s%s", w->url, path);
    char tp[PD_TRACEPARENT_LEN + 1] = "";
    const char *hdrs[] = {"traceparent", tp, NULL};
    if (j->is_traced) pd_traceparent_format(j->trace_id, j->span_id, tp);
    pd_http_client_request rq = {.method = "POST", .url = url, .body = txt, .body_len = strlen(txt),
                                 .headers = j->is_traced ? hdrs : NULL};
    pd_http_client_callbacks cb = {.on_headers = on_up_headers, .on_body = on_up_body,
                                   .on_sse = j->is_stream ? on_up_sse : NULL, .on_done = on_up_done};
    j->up_status = 0;
    j->len = 0;
    j->saw_done = j->saw_finish = j->got_chunk = false;
    j->t_dispatch_us = pd_time_us();
    if (!j->t_first_dispatch_us) j->t_first_dispatch_us = j->t_dispatch_us;
    pd_err err = {0};
    j->call = pd_http_client_send(r->client, &rq, &cb, j, &err);
    free(txt);  // jansson's allocator
    if (!j->call) return job_fail(j, 502, err.msg);
}

// Decides what to do after a failed upstream attempt on worker w.
static void retry_or_fail(rt_job *j, const char *why) {
    pd_router *r = j->rt;
    PD_LOG_W("router: request via %s failed: %s", j->w >= 0 ? r->workers[j->w].url : "?", why);
    worker_release(j);
    if (j->n_attempts >= r->max_attempts) return job_fail(j, 502, "router: every worker attempt failed");
    bool is_mid_stream = j->sse_started || j->n_gen > 0;
    if (is_mid_stream && (!j->can_continue || j->is_ids_missing))
        return job_fail(j, 502, "router: the worker failed mid-stream and the stream cannot be continued");
    if (is_mid_stream && j->max_tokens >= 0 && j->n_gen >= j->max_tokens) {
        // every token was relayed; only the finish chunk was lost with the worker
        if (j->http) {
            json_t *c = j->kind == RT_CHAT
                            ? json_pack("{s:s, s:I, s:s, s:[{s:i, s:{}, s:s}]}", "id", j->resp_id, "created",
                                        j->created, "object", "chat.completion.chunk", "choices", "index", 0,
                                        "delta", "finish_reason", "length")
                            : json_pack("{s:s, s:I, s:s, s:[{s:i, s:s, s:s}]}", "id", j->resp_id, "created",
                                        j->created, "object", "text_completion", "choices", "index", 0, "text",
                                        "", "finish_reason", "length");
            if (c) pd_http_sse_send_json(j->http, c);
            json_decref(c);
            pd_http_sse_end(j->http, true);
            j->http = NULL;
        }
        return job_end(j, true);
    }
    pd_metric_inc(is_mid_stream ? r->m_failovers : r->m_retries, 1);
    if (is_mid_stream) j->n_continuations++;
    if (is_mid_stream && !j->has_ids) {
        // The continuation needs the prompt as ids: tokenize on any healthy worker first.
        for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++)
            if (r->workers[i].is_used && r->workers[i].is_healthy) return job_tokenize(j, i);
        return job_fail(j, 503, "router: no healthy worker left");
    }
    job_dispatch(j);
}

static void on_up_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg,
                       void *ud) {
    rt_job *j = ud;
    pd_router *r = j->rt;
    j->call = NULL;
    if (st != PD_OK) {
        // connect failures take the worker out at once; mid-body failures count as failures too
        if (j->w >= 0) rt_worker_note_failure(r, j->w, !j->got_chunk || st == PD_ERR_IO);
        return retry_or_fail(j, msg);
    }
    if (j->is_stream && http_status == 200) {
        if (!j->saw_done && !j->saw_finish) return retry_or_fail(j, "stream ended without [DONE]");
        worker_release(j);
        if (j->http) {
            if (!j->sse_started) pd_http_sse_begin(j->http);
            pd_http_sse_end(j->http, true);
            j->http = NULL;
        }
        return job_end(j, true);
    }
    if (http_status == 503 && !j->sse_started && j->n_attempts < r->max_attempts)
        return retry_or_fail(j, "worker busy (503)");
    worker_release(j);
    if (j->http) {
        const char *ra = pd_http_client_call_header(call, "Retry-After");
        if (ra) pd_http_reply_header(j->http, "Retry-After", ra);
        json_t *o = http_status == 200 && !j->sse_started && j->buf ? json_loadb(j->buf, j->len, 0, NULL) : NULL;
        char *txt = NULL;
        if (json_is_object(json_object_get(o, "usage"))) {
            fix_usage(j, json_object_get(o, "usage"));
            txt = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        }
        json_decref(o);
        if (j->sse_started) {  // a non-200 continuation: the stream is already open
            pd_http_sse_send(j->http, j->buf ? j->buf : "", j->len);
            pd_http_sse_end(j->http, true);
        } else if (txt) {
            pd_http_reply(j->http, http_status, j->content_type, txt, strlen(txt));
        } else {
            pd_http_reply(j->http, http_status, j->content_type, j->buf ? j->buf : "", j->len);
        }
        free(txt);  // jansson's allocator
        j->http = NULL;
    }
    if (!j->t_first_us) j->t_first_us = pd_time_us();
    job_end(j, http_status == 200);
}

// ---- tokenize ---------------------------------------------------------------------------------------------
static void on_tok_done(pd_http_client_call *call, pd_status st, int http_status, const char *msg,
                        void *ud) {
    rt_job *j = ud;
    pd_router *r = j->rt;
    j->call = NULL;
    j->is_tokenizing = false;
    int32_t *ids = NULL, n = 0;
    if (st == PD_OK && http_status == 200 &&
        pd_wire_token_ids_decode(j->buf ? j->buf : "", j->len, &ids, &n, NULL) == PD_OK) {
        pd_free(j->prompt_ids);
        j->prompt_ids = ids;
        j->n_prompt = n;
        j->has_ids = true;
    } else {
        pd_metric_inc(r->m_tokenize_failures, 1);
        PD_LOG_D("router: tokenize failed (%d): %s", http_status, msg);
    }
    j->len = 0;
    if ((j->sse_started || j->n_gen > 0) && !j->has_ids)
        return job_fail(j, 502, "router: the worker failed mid-stream and the prompt could not be tokenized");
    job_dispatch(j);
}

static void job_tokenize(rt_job *j, int w) {
    pd_router *r = j->rt;
    char url[PD_WIRE_URL_MAX + 32];
    snprintf(url, sizeof url, "%s/internal/tokenize", r->workers[w].url);
    char *txt = json_dumps(j->body, JSON_COMPACT);
    if (!txt) return job_fail(j, 500, "router: out of memory");
    pd_http_client_request rq = {.method = "POST", .url = url, .body = txt, .body_len = strlen(txt)};
    pd_http_client_callbacks cb = {.on_headers = on_up_headers, .on_body = on_up_body, .on_done = on_tok_done};
    j->is_tokenizing = true;
    j->len = 0;
    pd_err err = {0};
    j->call = pd_http_client_send(r->poll_client, &rq, &cb, j, &err);
    free(txt);
    if (!j->call) {
        j->is_tokenizing = false;
        job_dispatch(j);
    }
}

// ---- dispatch: candidates, policy, admission --------------------------------------------------------
static double worker_prefill_tps(const pd_router *r, const rt_worker *w) {
    return w->load.prefill_tokens_per_s > 0 ? w->load.prefill_tokens_per_s : r->default_prefill_tps;
}

// The decode step at the worker's current batch: reported, else the router's observed gap scaled
// linearly from the batch it was observed at to the current in-flight count, else a default.
static double worker_step_ms(const pd_router *r, const rt_worker *w) {
    if (w->load.decode_step_ms > 0) return w->load.decode_step_ms;
    if (w->obs_step_ms > 0) return w->obs_step_ms * PD_MAX(1.0, w->n_inflight) / PD_MAX(1.0, w->obs_batch);
    return r->default_step_ms;
}

// Prefill work the router has sent to each worker and believes not yet done: for every job there
// without a first chunk, its uncached tokens minus what the worker's prefill rate has worked off
// since dispatch. (Non-streaming jobs never show a first chunk; the decay retires them.)
static void queued_by_worker(const pd_router *r, int64_t now_us, int64_t out[PD_ROUTER_MAX_WORKERS]) {
    memset(out, 0, PD_ROUTER_MAX_WORKERS * sizeof *out);
    for (const rt_job *o = r->jobs; o; o = o->next) {
        if (o->w < 0 || o->got_chunk || o->pending_tokens <= 0) continue;
        double done = (double)(now_us - o->t_dispatch_us) / 1e6 * worker_prefill_tps(r, &r->workers[o->w]);
        if ((double)o->pending_tokens > done) out[o->w] += o->pending_tokens - (int64_t)done;
    }
}

// Fills cands for every eligible worker with room (pd_router_has_room); returns how many.
// *n_full: healthy decode-capable workers left out because they were full.
static int build_cands(rt_job *j, pd_router_cand *cands, int *n_full) {
    pd_router *r = j->rt;
    int32_t hit_blocks[64] = {0}, any_blocks[64] = {0};
    int64_t queued[PD_ROUTER_MAX_WORKERS];
    queued_by_worker(r, pd_time_us(), queued);
    int32_t bs_done = 0;
    pd_hash128 *hashes = NULL;
    int n = 0;
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        rt_worker *w = &r->workers[i];
        if (!w->is_used || !w->is_healthy || w->role == PD_WIRE_ROLE_PREFILL) continue;
        if (j->tried & (1ull << i)) continue;
        if (j->has_ids && w->block_size != bs_done && w->block_size > 0) {
            pd_free(hashes);
            hashes = pd_malloc(((size_t)j->n_prompt / (size_t)w->block_size + 1) * sizeof *hashes);
            bs_done = w->block_size;
            int nh = hashes ? pd_router_hash_prompt(j->prompt_ids, j->n_prompt, bs_done, hashes) : 0;
            uint64_t same_bs = 0;
            for (int k = 0; k < PD_ROUTER_MAX_WORKERS; k++)
                if (r->workers[k].is_used && r->workers[k].block_size == bs_done) same_bs |= 1ull << k;
            pd_router_prefix_match(r->prefix, hashes, nh, same_bs, hit_blocks);
            pd_router_prefix_match_tiers(r->prefix, hashes, nh, same_bs, any_blocks);
        }
        pd_router_cand *c = &cands[n++];
        memset(c, 0, sizeof *c);
        c->idx = i;
        c->n_prompt_tokens = j->n_prompt;
        c->n_hit_tokens = j->has_ids ? hit_blocks[i] * w->block_size : 0;
        c->n_tier_hit_tokens = j->has_ids ? PD_MAX(0, any_blocks[i] - hit_blocks[i]) * w->block_size : 0;
        c->tier_us_per_token =
            w->load.n_tier_hit_tokens > 0 ? (double)w->load.tier_load_us / (double)w->load.n_tier_hit_tokens : 0;
        c->n_running = w->has_state ? w->load.n_running : w->n_inflight;
        c->n_waiting = w->load.n_waiting;
        c->n_queued_prefill_tokens = PD_MAX(w->load.n_waiting_prefill_tokens, queued[i]);
        c->n_inflight = w->n_inflight;
        c->kv_free_frac = w->load.n_kv_blocks_total > 0
                              ? (double)w->load.n_kv_blocks_free / w->load.n_kv_blocks_total : 1.0;
        c->prefill_tokens_per_s = worker_prefill_tps(r, w);
        c->decode_step_ms = worker_step_ms(r, w);
        c->ttft_ms_per_inflight = w->obs_ttft_per_inflight;
        c->n_capacity = rt_worker_capacity(r, w);
        c->n_foreign = w->n_foreign;
        c->n_kv_blocks_total = w->load.n_kv_blocks_total;
        int64_t need = (int64_t)j->n_prompt + (j->max_tokens > 0 ? j->max_tokens : 0);
        c->n_blocks_needed = (int32_t)PD_MIN((need + w->block_size - 1) / PD_MAX(1, w->block_size), INT32_MAX);
        if (w->has_model && j->has_ids) {  // the worker's own local-versus-remote model (wire/link.h)
            double us = pd_disagg_predict_us(&w->model_dm, c->n_prompt_tokens - PD_MIN(c->n_hit_tokens, c->n_prompt_tokens), NULL);
            if (us >= 0) c->has_prefill_pred = true, c->prefill_pred_ms = us / 1000.0;
        }
        if (!pd_router_has_room(c)) {  // full: not a candidate
            n--;
            (*n_full)++;
        }
    }
    pd_free(hashes);
    return n;
}

static int choose(rt_job *j, const pd_router_cand *cands, int n) {
    pd_router *r = j->rt;
    pd_router_cost_params cp = r->cost;
    switch (r->routing) {
        case PD_ROUTER_ROUTING_ROUND_ROBIN: return (int)(r->rr_next++ % (unsigned)n);
        case PD_ROUTER_ROUTING_RANDOM: return (int)(pd_rng_next(&r->rng) % (uint64_t)n);
        case PD_ROUTER_ROUTING_LOAD: cp.use_prefix = false; break;
        default: cp.use_prefix = true; break;
    }
    return pd_router_pick(&cp, cands, n, r->rr_next++);
}

// NOTE: predictions are compared with PD_ROUTER_SLO_HEADROOM × the SLO: the observed TTFT grows
// faster than linearly with load (running decodes share every step with new prefills) and the
// per-in-flight estimate lags a burst, and a refused request costs the client one retry while an
// accepted one that misses breaks the promise. 0.8 let 27% of a 200-request burst's accepted
// requests miss a 500 ms SLO on a 2-core CPU; 0.6 kept all of them within it (test_router.sh).
#define PD_ROUTER_SLO_HEADROOM 0.6

static bool meets_slo(const pd_router_class *cls, const pd_router_cand *c) {
    // An idle worker is never a reason to refuse: there is nothing to wait for, and its reported
    // rates may be stale averages from its last burst.
    if (c->n_inflight == 0 && c->n_running == 0 && c->n_waiting == 0) return true;
    if (cls->slo_ttft_ms > 0 && pd_router_predict_ttft_ms(c) > PD_ROUTER_SLO_HEADROOM * cls->slo_ttft_ms) return false;
    if (cls->slo_tpot_ms > 0 && pd_router_predict_tpot_ms(c) > PD_ROUTER_SLO_HEADROOM * cls->slo_tpot_ms) return false;
    return true;
}

static void reject(rt_job *j, int status, const char *msg, const char *code, pd_metric *m) {
    pd_metric_inc(m, 1);
    rt_history_note(j->rt, j->class_idx, 0, 0, true);
    if (j->http) reply_error(j->http, status, status == 429 ? "rate_limit_error" : "server_error", msg, code, 1);
    j->http = NULL;
    job_end(j, false);
}

static void job_dispatch(rt_job *j) {
    pd_router *r = j->rt;
    pd_router_cand cands[PD_ROUTER_MAX_WORKERS];
    int n_full = 0;
    int n = build_cands(j, cands, &n_full);
    if (n == 0 && n_full > 0 && !j->sse_started && j->n_gen == 0)
        return reject(j, 503, "router: every decode worker is full (running and queued requests at its capacity); retry later",
                      "capacity", r->cm[j->class_idx].rejected_capacity);
    if (n == 0) return job_fail(j, 503, "router: no healthy decode worker available");
    int k = choose(j, cands, n);
    const pd_router_class *cls = &r->qos.classes[j->class_idx];
    if (!j->is_admitted && !meets_slo(cls, &cands[k])) {
        // the policy's pick would miss the SLO: take the candidate with the best prediction
        int best = -1;
        for (int i = 0; i < n; i++)
            if (meets_slo(cls, &cands[i]) &&
                (best < 0 || pd_router_predict_ttft_ms(&cands[i]) < pd_router_predict_ttft_ms(&cands[best])))
                best = i;
        if (best < 0)
            return reject(j, 503, "router: the request would miss its latency SLO; retry later",
                          "slo_unattainable", r->cm[j->class_idx].rejected_slo);
        k = best;
    }
    j->is_admitted = true;
    const pd_router_cand *c = &cands[k];
    rt_worker *w = &r->workers[c->idx];
    j->w = c->idx;
    j->tried |= 1ull << c->idx;
    j->n_attempts++;
    w->n_inflight++;
    w->n_routed++;
    pd_metric_inc(w->m_routed, 1);
    pd_metric_inc(r->m_decisions[r->routing], 1);
    if (j->n_attempts == 1 && j->has_ids) {
        w->n_pred_query_tokens += j->n_prompt;
        w->n_pred_hit_tokens += c->n_hit_tokens;
        pd_metric_inc(r->m_prefix_query, j->n_prompt);
        pd_metric_inc(r->m_prefix_hit, c->n_hit_tokens);
        // Optimistic insert: the blocks will be cached there once prefilled, and the next request
        // with this prefix should not wait a heartbeat to learn it (events confirm or remove).
        int nb = j->n_prompt / w->block_size;
        pd_hash128 *h = pd_malloc(((size_t)nb + 1) * sizeof *h);
        if (h) {
            nb = pd_router_hash_prompt(j->prompt_ids, j->n_prompt, w->block_size, h);
            for (int i = 0; i < nb; i++) (void)pd_router_prefix_add(r->prefix, h[i], c->idx);
        }
        pd_free(h);
    }
    j->pending_tokens = j->n_prompt - c->n_hit_tokens + j->n_gen;
    j->queued_at_dispatch = c->n_queued_prefill_tokens;
    j->inflight_at_dispatch = w->n_inflight - 1;  // others already there
    send_upstream(j);
}

// ---- entry ---------------------------------------------------------------------------------------------------
// Token ids straight from a completions body (prompt: [ids]), or false.
static bool prompt_ids_from_body(rt_job *j) {
    json_t *p = json_object_get(j->body, "prompt");
    size_t n = json_array_size(p);
    if (j->kind != RT_COMPLETIONS || !json_is_array(p) || n == 0 || !json_is_integer(json_array_get(p, 0)))
        return false;
    j->prompt_ids = pd_malloc(n * sizeof *j->prompt_ids);
    if (!j->prompt_ids) return false;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(p, i);
        if (!json_is_integer(x)) return false;
        j->prompt_ids[i] = (int32_t)json_integer_value(x);
    }
    j->n_prompt = (int32_t)n;
    return true;
}

// Rough prompt size without ids (4 bytes per token), for admission when tokenize is unavailable.
static int32_t estimate_prompt_tokens(json_t *body) {
    char *txt = json_dumps(body, JSON_COMPACT);
    size_t n = txt ? strlen(txt) : 0;
    free(txt);
    return (int32_t)PD_MIN(n / 4 + 1, (size_t)INT32_MAX);
}

static const char *api_key_of(pd_http_req *req) {
    const char *a = pd_http_req_header(req, "Authorization");
    if (!a) return NULL;
    if (!strncasecmp(a, "Bearer ", 7)) a += 7;
    return *a ? a : NULL;
}

static pd_router_bucket *bucket_for(pd_router *r, const char *key) {
    for (int i = 0; i < r->n_buckets; i++)
        if (!strcmp(r->buckets[i].key, key)) return &r->buckets[i].bucket;
    if (r->n_buckets >= PD_ROUTER_MAX_KEYS || strlen(key) >= sizeof r->buckets[0].key) return NULL;
    snprintf(r->buckets[r->n_buckets].key, sizeof r->buckets[0].key, "%s", key);
    memset(&r->buckets[r->n_buckets].bucket, 0, sizeof(pd_router_bucket));
    return &r->buckets[r->n_buckets++].bucket;
}

static void handle(pd_http_req *req, pd_router *r, rt_kind kind) {
    size_t len;
    const char *body = pd_http_req_body(req, &len);
    json_t *root = json_loadb(body, len, 0, NULL);
    if (!json_is_object(root)) {
        json_decref(root);
        return pd_http_reply_error(req, 400, "invalid_request_error", "body must be a JSON object", NULL, NULL);
    }
    const char *key = api_key_of(req);
    int ci = pd_router_qos_select(&r->qos, pd_http_req_header(req, "x-priority"), key);
    const pd_router_class *cls = &r->qos.classes[ci];
    pd_metric_inc(r->cm[ci].requests, 1);
    if (cls->rate_limit_rps > 0) {
        char bk[160];
        snprintf(bk, sizeof bk, "%s/%s", cls->name, key ? key : "-");
        pd_router_bucket *b = bucket_for(r, bk);
        if (b && !pd_router_bucket_take(b, cls->rate_limit_rps, cls->rate_burst, pd_time_us())) {
            json_decref(root);
            pd_metric_inc(r->cm[ci].rejected_rate, 1);
            rt_history_note(r, ci, 0, 0, true);
            return reply_error(req, 429, "rate_limit_error", "rate limit exceeded for this API key",
                               "rate_limit_exceeded", 1);
        }
    }
    if (rt_n_decode_healthy(r) == 0) {
        json_decref(root);
        return reply_error(req, 503, "server_error", "router: no healthy decode worker available", NULL, 1);
    }
    // Reserved capacity (only when a --qos-config reserves some): the pool's capacity is the sum
    // of the decode-capable workers' own (pd_router_worker_capacity); unknown = no refusal here.
    int64_t pool = rt_pool_capacity(r);
    if (pool > 0 && !pd_router_qos_admit(&r->qos, ci, r->inflight_by_class, (int)PD_MIN(pool, INT32_MAX))) {
        json_decref(root);
        pd_metric_inc(r->cm[ci].rejected_capacity, 1);
        rt_history_note(r, ci, 0, 0, true);
        return reply_error(req, 503, "server_error", "router: at capacity for this class; retry later",
                           "capacity", 1);
    }
    rt_job *j = pd_calloc(1, sizeof *j);
    if (!j) {
        json_decref(root);
        return pd_http_reply_error(req, 500, "server_error", "router: out of memory", NULL, NULL);
    }
    j->rt = r;
    j->http = req;
    j->kind = kind;
    j->body = root;
    j->class_idx = ci;
    j->w = -1;
    j->t_arrival_us = pd_time_us();
    j->is_stream = json_is_true(json_object_get(root, "stream"));
    j->wants_ids = json_is_true(json_object_get(root, "return_token_ids"));
    json_t *so = json_object_get(root, "stream_options");
    j->wants_usage = json_is_true(json_object_get(so, "include_usage"));
    j->wants_timings = json_is_true(json_object_get(root, "timings")) || json_is_true(json_object_get(so, "include_timings"));
    if (pd_trace_enabled()) {
        pd_trace_ctx in;
        if (pd_traceparent_parse(pd_http_req_header(req, "traceparent"), &in) == PD_OK) {
            memcpy(j->trace_id, in.trace_id, 16);
            memcpy(j->parent_span_id, in.span_id, 8);
            j->has_parent_span = true;
        } else {
            pd_trace_new_trace_id(j->trace_id);
        }
        pd_trace_new_span_id(j->span_id);
        j->is_traced = true;
    }
    json_t *mt = json_object_get(root, kind == RT_CHAT && json_object_get(root, "max_completion_tokens")
                                           ? "max_completion_tokens" : "max_tokens");
    j->max_tokens = json_is_integer(mt) ? (long)json_integer_value(mt) : -1;
    json_t *nn = json_object_get(root, "n");
    json_t *p = json_object_get(root, "prompt");
    bool multi_prompt = json_is_array(p) && json_array_size(p) > 0 && !json_is_integer(json_array_get(p, 0));
    j->can_continue = j->is_stream && (!json_is_integer(nn) || json_integer_value(nn) == 1) && !multi_prompt;
    j->next = r->jobs;
    if (r->jobs) r->jobs->prev = j;
    r->jobs = j;
    r->inflight_by_class[ci]++;
    pd_metric_set(r->cm[ci].inflight, r->inflight_by_class[ci]);
    pd_http_req_set_close_cb(req, on_client_close, j);
    j->has_ids = prompt_ids_from_body(j);
    if (!j->has_ids) {
        pd_free(j->prompt_ids);
        j->prompt_ids = NULL;
        j->n_prompt = estimate_prompt_tokens(root);
    }
    if (!j->has_ids && !multi_prompt &&
        (r->routing == PD_ROUTER_ROUTING_KV || cls->slo_ttft_ms > 0)) {
        int w = -1;
        for (int k = 0; k < PD_ROUTER_MAX_WORKERS && w < 0; k++) {
            int i = (int)((r->rr_next + (unsigned)k) % PD_ROUTER_MAX_WORKERS);
            if (r->workers[i].is_used && r->workers[i].is_healthy && r->workers[i].role != PD_WIRE_ROLE_PREFILL) w = i;
        }
        if (w >= 0) return job_tokenize(j, w);
    }
    job_dispatch(j);
}

void rt_handle_completions(pd_http_req *req, void *ud) { handle(req, ud, RT_COMPLETIONS); }
void rt_handle_chat(pd_http_req *req, void *ud) { handle(req, ud, RT_CHAT); }

void rt_jobs_free_all(pd_router *r) {
    while (r->jobs) {
        rt_job *j = r->jobs;
        if (j->http) {
            pd_http_req_set_close_cb(j->http, NULL, NULL);
            j->http = NULL;
        }
        job_free(j);
    }
}
