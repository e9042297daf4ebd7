// job.c — what happens to a request once it is in the engine: engine events → text → SSE chunks
// or an accumulated reply.
//
// Per TOKEN event of a choice:
//   token ─► (EOS / stop id: no text) ─► pd_tok_stream (UTF-8-safe detokenizer)
//         ─► pd_tok_stop (holds back text that may start a stop string)
//         ─► streaming: one chunk with the new text (and its logprobs)
//            otherwise: append to the choice's text
//   a stop string completed ─► pd_engine_abort(id), the choice finishes with "stop"; its
//   engine FINISHED(ABORT) event is dropped because the id has left the table.
// Per FINISHED event: flush the detokenizer and the matcher, then finish the choice with the
// engine's reason. When the last choice finishes the job replies (or ends the stream with the
// usage chunk and [DONE]) and is freed.
#include <ctype.h>
#include <string.h>

#include "api/api_impl.h"

static void append_text(api_choice *c, const char *s, size_t n) {
    if (!n) return;
    if (PD_ARRAY_RESERVE(c->text, c->cap, c->len + n + 1) != PD_OK) {  // overflow-checked
        c->job->has_error = true;
        c->job->error_status = PD_ERR_NOMEM;
        return;
    }
    memcpy(c->text + c->len, s, n);
    c->len += n;
    c->text[c->len] = 0;
}

static void send_chunk(api_choice *c, json_t *o) {
    if (o && c->job->http) pd_http_sse_send_json(c->job->http, o);
    json_decref(o);
}

// Sends or accumulates text (and lp, stolen) for c.
// With return_token_ids, the id of the current token rides on the first chunk sent for it.
// Streaming with tools: the text is held back while it may be a tool call (always, for a required
// or named choice; for "auto" when its first non-blank character may open one), and sent as
// content as soon as it cannot be.
static void emit(api_choice *c, const char *text, size_t len, json_t *lp, const char *finish) {
    api_job *j = c->job;
    if (j->stream && j->parse_tools && c->tool_state != TOOL_CONTENT && !finish) {
        if (c->tool_state == TOOL_UNDECIDED && j->tools_forced) c->tool_state = TOOL_BUFFER;
        for (size_t i = 0; i < len && c->tool_state == TOOL_UNDECIDED; i++)
            if (!isspace((unsigned char)text[i]))
                c->tool_state = pd_api_tools_may_open(j->tool_fmt, text[i]) ? TOOL_BUFFER : TOOL_CONTENT;
        append_text(c, text, len);
        c->text_offset += len;
        if (c->tool_state != TOOL_CONTENT) {
            json_decref(lp);
            return;
        }
        bool with_id = j->return_ids && c->has_cur_id;
        send_chunk(c, pd_api_chunk_json(j, c, c->text, c->len, lp, NULL, &c->cur_id, !j->return_ids ? -1 : with_id ? 1 : 0));
        c->has_cur_id = false;
        c->len = 0;
        return;
    }
    if (j->stream) {
        if (!len && !lp && !finish) return;
        bool with_id = j->return_ids && c->has_cur_id;
        json_t *o = pd_api_chunk_json(j, c, text, len, lp, finish, &c->cur_id, !j->return_ids ? -1 : with_id ? 1 : 0);
        c->has_cur_id = false;
        if (o && j->http) pd_http_sse_send_json(j->http, o);
        json_decref(o);
    } else {
        append_text(c, text, len);
        json_decref(lp);
    }
    c->text_offset += len;
}

static void count_finish(pd_api *a, const char *reason) {
    pd_metric *m = !strcmp(reason, "stop")     ? a->m.fin_stop
                   : !strcmp(reason, "length") ? a->m.fin_length
                   : !strcmp(reason, "abort")  ? a->m.fin_abort
                                               : a->m.fin_error;
    pd_metric_inc(m, 1);
}

static void job_complete(api_job *j) {
    pd_api *a = j->api;
    pd_metric_observe(a->m.e2e, (double)(pd_time_us() - j->t_arrival_us) / 1e6);
    pd_api_trace_end(j, pd_time_us());
    if (j->http) {
        if (j->has_error && !j->stream) {
            const char *type;
            int http = pd_api_status_http(j->error_status, &type);
            pd_http_reply_error(j->http, http, type, j->error_msg[0] ? j->error_msg : "internal error", NULL, NULL);
        } else if (j->stream) {
            if (j->has_error) {
                json_t *e = pd_http_error_body("server_error", j->error_msg[0] ? j->error_msg : "internal error",
                                               NULL, NULL);
                if (e) pd_http_sse_send_json(j->http, e);
                json_decref(e);
            }
            if (j->include_usage) {
                json_t *u = pd_api_usage_chunk_json(j);
                if (u) pd_http_sse_send_json(j->http, u);
                json_decref(u);
            }
            pd_http_sse_end(j->http, true);
        } else {
            json_t *o = pd_api_response_json(j);
            if (o) pd_http_reply_json(j->http, 200, o);
            else pd_http_reply_error(j->http, 500, "server_error", "out of memory", NULL, NULL);
            json_decref(o);
        }
        j->http = NULL;
    }
    pd_api_job_free(j);
}

// Tools: parses the held-back (streaming) or whole (non-streaming) text for calls; streaming, sends
// the content before them and one tool_calls delta per call. Returns the finish reason.
static const char *finish_tools(api_choice *c, const char *reason) {
    api_job *j = c->job;
    if (j->stream && c->tool_state == TOOL_CONTENT) return reason;
    size_t clen = 0;
    json_t *calls = c->len ? pd_api_tools_parse(c->text, c->len, j->tool_fmt, j->tools, &j->api->rng, &clen) : NULL;
    c->tool_calls = calls;
    c->content_len = clen;
    if (j->stream && !j->has_error) {
        size_t n = calls ? clen : c->len;
        if (n) send_chunk(c, pd_api_chunk_json(j, c, c->text, n, NULL, NULL, NULL, j->return_ids ? 0 : -1));
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call) send_chunk(c, pd_api_tool_call_chunk_json(j, c, (int)k, call));
    }
    return calls && !strcmp(reason, "stop") ? "tool_calls" : reason;  // cut by max_tokens: "length"
}

static void finish_choice(api_choice *c, const char *reason) {
    api_job *j = c->job;
    pd_api *a = j->api;
    if (c->is_done) return;
    c->is_done = true;
    if (j->parse_tools) reason = finish_tools(c, reason);
    c->finish_reason = reason;
    if (c->is_live) {
        pd_api_idmap_del(&a->ids, c->id);
        c->is_live = false;
    }
    count_finish(a, reason);
    if (j->stream && !j->has_error) emit(c, "", 0, NULL, reason);
    if (++j->n_done == j->n_choices) job_complete(j);
}

static bool is_stop_token(const api_job *j, int32_t tok) {
    for (int i = 0; i < j->n_stop_ids; i++)
        if (j->stop_ids[i] == tok) return true;
    return false;
}

// Runs fresh detokenized text through the stop matcher and emits what is safe. Returns true when
// a stop string completed.
static bool push_text(api_choice *c, const char *t, size_t n, json_t *lp, bool is_final) {
    if (!c->stop) {
        emit(c, t, n, lp, NULL);
        return false;
    }
    pd_tok_stop_result sr;
    pd_status st = n || !is_final ? pd_tok_stop_feed(c->stop, t, n, &sr) : PD_OK;
    if (st) {
        json_decref(lp);
        return false;
    }
    if (!is_final || (n && sr.is_stopped)) {
        emit(c, sr.text, sr.len, lp, NULL);
        return sr.is_stopped;
    }
    // End of the sequence: fed the last text above (if any), now release what was held back.
    if (n) emit(c, sr.text, sr.len, NULL, NULL);
    if (pd_tok_stop_finish(c->stop, &sr) == PD_OK) emit(c, sr.text, sr.len, lp, NULL);
    else json_decref(lp);
    return false;
}

static void on_token(api_choice *c, const pd_engine_event *ev) {
    api_job *j = c->job;
    pd_api *a = j->api;
    int64_t now = pd_time_us();
    if (c->n_tokens == 0) {
        pd_metric_observe(a->m.ttft, (double)(now - j->t_arrival_us) / 1e6);
        pd_api_ttft_note(j, ev, now);
        c->n_cached = ev->n_cached_tokens;
    } else {
        pd_metric_observe(a->m.itl, (double)(now - c->t_last_us) / 1e6);
    }
    c->t_last_us = now;
    c->n_tokens++;
    json_t *lp = NULL;
    if (j->logprobs >= 0 && !j->has_error &&
        pd_api_logprobs_append(j, a->tok, &ev->tok, c->text_offset, &lp)) {
        json_decref(lp);
        lp = NULL;
    }
    if (lp && !j->stream) {  // non-streaming: logprobs accumulate in c->lp
        if (!c->lp) c->lp = lp;
        else {
            const char *k;
            json_t *v;
            json_object_foreach(lp, k, v) json_array_extend(json_object_get(c->lp, k), v);
            json_decref(lp);
        }
        lp = NULL;
    }
    int32_t t = ev->tok.token;
    if (j->return_ids) {
        if (j->stream) {
            c->cur_id = t;
            c->has_cur_id = true;
        } else if (pd_tok_ids_push(&c->ids, t)) {
            j->has_error = true;
            j->error_status = PD_ERR_NOMEM;
        }
    }
    const char *txt = "";
    size_t n = 0;
    bool silent = is_stop_token(j, t);  // EOS / stop ids end the text, they are not part of it
    if (!silent && pd_tok_stream_feed(c->detok, t, &txt, &n)) n = 0;
    bool stopped = push_text(c, txt, n, lp, false);
    if (c->has_cur_id) {  // no text came out for this token: send its id alone
        json_t *o = pd_api_chunk_json(j, c, "", 0, NULL, NULL, &c->cur_id, 1);
        if (o && j->http) pd_http_sse_send_json(j->http, o);
        json_decref(o);
        c->has_cur_id = false;
    }
    if (stopped) {
        pd_engine_abort(a->engine, c->id);
        finish_choice(c, "stop");
    }
}

static void on_finished(api_choice *c, const pd_engine_event *ev) {
    api_job *j = c->job;
    if (c->n_tokens == 0) c->n_cached = ev->n_cached_tokens;
    c->spec_method = ev->spec_method;
    c->n_spec_drafted = ev->n_spec_drafted;
    c->n_spec_accepted = ev->n_spec_accepted;
    c->n_spec_steps = ev->n_spec_steps;
    const char *txt = "";
    size_t n = 0;
    if (pd_tok_stream_finish(c->detok, &txt, &n)) n = 0;
    if (push_text(c, txt, n, NULL, true)) {
        finish_choice(c, "stop");
        return;
    }
    switch (ev->finish) {
    case PD_ENGINE_FINISH_LENGTH: finish_choice(c, "length"); break;
    case PD_ENGINE_FINISH_STOP: finish_choice(c, "stop"); break;
    case PD_ENGINE_FINISH_ABORT: finish_choice(c, "abort"); break;
    default:
        if (!j->has_error) {
            j->has_error = true;
            j->error_status = PD_ERR_INVALID;
            snprintf(j->error_msg, sizeof j->error_msg,
                     "the request could not be served (it does not fit in the KV cache or the device failed)");
        }
        finish_choice(c, "error");
        break;
    }
}

void pd_api_job_on_event(pd_api *a, const pd_engine_event *ev) {
    api_choice *c = pd_api_idmap_get(&a->ids, ev->id);
    if (!c || c->is_done) return;  // finished already, or its client went away
    if (ev->kind == PD_EV_TOKEN) on_token(c, ev);
    else if (ev->kind == PD_EV_FINISHED) on_finished(c, ev);
}

void pd_api_job_stream_begin(api_job *j) {
    pd_http_sse_begin(j->http);
    if (j->kind != PD_API_CHAT) return;
    for (int i = 0; i < j->n_choices; i++) {  // chat: {"role":"assistant","content":""} first
        json_t *o = pd_api_chunk_json(j, &j->choices[i], "", 0, NULL, NULL, NULL, -1);
        json_t *ch = o ? json_array_get(json_object_get(o, "choices"), 0) : NULL;
        json_t *d = json_pack("{s:s,s:s}", "role", "assistant", "content", "");
        if (ch && d) {
            json_object_set_new(ch, "delta", d);
            pd_http_sse_send_json(j->http, o);
        } else {
            json_decref(d);
        }
        json_decref(o);
    }
}

void pd_api_job_cancel(api_job *j) {
    pd_api *a = j->api;
    for (int i = 0; i < j->n_choices; i++) {
        api_choice *c = &j->choices[i];
        if (!c->is_live) continue;
        pd_engine_abort(a->engine, c->id);
        pd_api_idmap_del(&a->ids, c->id);
        c->is_live = false;
        if (!c->is_done) count_finish(a, "abort");
    }
    j->http = NULL;
    pd_api_job_free(j);
}

void pd_api_job_free(api_job *j) {
    if (!j) return;
    pd_api *a = j->api;
    for (int i = 0; i < j->n_choices; i++) {
        api_choice *c = &j->choices[i];
        if (c->is_live) {  // never leave a dangling pointer in the id table
            pd_engine_abort(a->engine, c->id);
            pd_api_idmap_del(&a->ids, c->id);
        }
        pd_tok_stream_free(c->detok);
        pd_tok_stop_free(c->stop);
        pd_free(c->text);
        pd_tok_ids_free(&c->ids);
        json_decref(c->lp);
        json_decref(c->tool_calls);
    }
    json_decref(j->tools);
    pd_free(j->choices);
    if (j->prev) j->prev->next = j->next;
    else if (a->jobs == j) a->jobs = j->next;
    if (j->next) j->next->prev = j->prev;
    a->n_jobs--;
    pd_free(j);
}
