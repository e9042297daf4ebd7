// server.c — pd_api: routes, the completion / chat handlers (parse → tokenize → submit), the
// engine event watcher, /v1/models, /health, /metrics, and the id table.
//
// Everything here runs on the event-loop thread: HTTP callbacks, the engine-event callback (the
// engine fd is readable while events are pending) and metric rendering, so no state here needs a
// lock. Parsing, chat templating and tokenizing a body run on the preparation pool (prep.c), whose
// results come back to this thread.
#include <event2/event.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api_impl.h"
#include "api/prep.h"

// ---- id table: engine request id -> choice, a pd_map (base/map.h) ---------------------------------

typedef struct id_entry {
    uint64_t id;
    api_choice *c;
} id_entry;

api_choice *pd_api_idmap_get(api_idmap *m, uint64_t id) {
    const id_entry *e = pd_map_find(&m->map, pd_map_mix64(id), &id);
    return e ? e->c : NULL;
}

pd_status pd_api_idmap_put(api_idmap *m, uint64_t id, api_choice *c) {
    if (!m->map.stride)
        PD_ASSERT(pd_map_init(&m->map, &(pd_map_params){.entry_size = sizeof(id_entry), .key_size = 8}) == PD_OK);
    id_entry *e = pd_map_put(&m->map, pd_map_mix64(id), &id, NULL);
    if (!e) return PD_ERR_NOMEM;
    e->c = c;
    return PD_OK;
}

void pd_api_idmap_del(api_idmap *m, uint64_t id) { pd_map_del(&m->map, pd_map_mix64(id), &id); }

void pd_api_idmap_fini(api_idmap *m) { pd_map_fini(&m->map); }

// ---- helpers -----------------------------------------------------------------------------------

static void reply_api_error(pd_http_req *r, const pd_api_error *e) {
    const char *type;
    int http = pd_api_status_http(e->status, &type);
    if (e->status == PD_NOSPACE || e->status == PD_AGAIN) pd_http_reply_header(r, "Retry-After", "1");
    pd_http_reply_error(r, http, type, e->message, e->param[0] ? e->param : NULL, e->code);
}

static void on_client_close(pd_http_req *r, void *ud) {
    api_job *j = ud;
    PD_UNUSED(r);
    pd_api_job_cancel(j);
}

static api_job *job_new(pd_api *a, pd_http_req *http, const pd_api_request *rq, const pd_api_prompts *pr) {
    api_job *j = pd_calloc(1, sizeof *j);
    if (!j) return NULL;
    j->api = a;
    j->http = http;
    j->kind = rq->kind;
    j->stream = rq->stream;
    j->include_usage = rq->include_usage;
    j->return_ids = rq->return_token_ids;
    j->ignore_eos = rq->ignore_eos;
    j->logprobs = rq->logprobs;
    j->n = rq->n;
    j->parse_tools = rq->tools && rq->tool_choice != PD_API_TOOL_CHOICE_NONE;
    j->tools_forced = rq->tool_choice >= PD_API_TOOL_CHOICE_REQUIRED;
    j->tool_fmt = rq->tool_format;
    j->tools = j->parse_tools ? json_incref(rq->tools) : NULL;
    j->created = (int64_t)time(NULL);
    j->t_arrival_us = pd_time_us();
    j->include_timings = rq->include_timings;
    pd_api_trace_begin(j, http ? pd_http_req_header(http, "traceparent") : NULL);
    snprintf(j->id, sizeof j->id, "%s%016llx%08llx", rq->kind == PD_API_CHAT ? "chatcmpl-" : "cmpl-",
             (unsigned long long)pd_rng_next(&a->rng), (unsigned long long)(++a->n_jobs_total & 0xffffffffu));
    for (int i = 0; i < rq->n_stop_ids; i++) j->stop_ids[j->n_stop_ids++] = rq->stop_ids[i];
    int32_t eos = pd_tok_eos_id(a->tok);
    if (!rq->ignore_eos && eos >= 0) j->stop_ids[j->n_stop_ids++] = eos;
    for (int i = 0; i < pr->n; i++) j->n_prompt_tokens += pr->items[i].n;
    j->n_choices = pr->n * rq->n;
    j->choices = pd_calloc((size_t)j->n_choices, sizeof *j->choices);
    // Link first so pd_api_job_free can always unlink.
    j->next = a->jobs;
    if (a->jobs) a->jobs->prev = j;
    a->jobs = j;
    a->n_jobs++;
    if (!j->choices) {
        j->n_choices = 0;
        pd_api_job_free(j);
        return NULL;
    }
    for (int i = 0; i < j->n_choices; i++) {
        api_choice *c = &j->choices[i];
        c->job = j;
        c->index = i;
        c->prompt_idx = i / rq->n;
        c->detok = pd_tok_stream_new(a->tok, rq->skip_special_tokens);
        if (!c->detok) goto fail;
        if (rq->n_stops) {
            c->stop = pd_tok_stop_new(rq->stops, rq->n_stops, rq->include_stop_str_in_output, NULL);
            if (!c->stop) goto fail;
        }
    }
    return j;
fail:
    pd_api_job_free(j);
    return NULL;
}

// Submits every choice; on failure aborts those already queued and fills e.
static pd_status job_submit(api_job *j, const pd_api_request *rq, const pd_api_prompts *pr, pd_grammar *g,
                            pd_api_error *e) {
    pd_api *a = j->api;
    for (int i = 0; i < j->n_choices; i++) {
        api_choice *c = &j->choices[i];
        pd_engine_request er = {0};
        er.id = ++a->next_id;
        er.prompt = pr->items[c->prompt_idx].ids;
        er.n_prompt = pr->items[c->prompt_idx].n;
        er.max_tokens = pr->max_tokens[c->prompt_idx];
        er.ignore_eos = rq->ignore_eos;
        er.stop_ids = rq->stop_ids;
        er.n_stop_ids = rq->n_stop_ids;
        er.sampling = rq->sampling;
        if (rq->sampling.has_seed) er.sampling.seed = rq->sampling.seed + (uint64_t)c->index;
        // vLLM's `priority`: lower values run first; the engine runs higher values first.
        er.priority = rq->priority == INT_MIN ? INT_MAX : -rq->priority;
        er.arrival_us = j->t_arrival_us;
        pd_api_trace_traceparent(j, er.traceparent);
        pd_err err = {0};
        pd_status st = pd_api_choice_ctl(a, rq, g, &pr->items[c->prompt_idx], &er.ctl);  // logit bias, grammar
        if (st == PD_ERR_INVALID) {
            e->status = st;
            snprintf(e->param, sizeof e->param, "continuation_tokens");
            snprintf(e->message, sizeof e->message, "the continuation tokens do not follow the request's grammar");
            e->code = NULL;
            return st;
        }
        if (st == PD_OK) st = pd_api_idmap_put(&a->ids, er.id, c);
        if (st == PD_OK) {
            st = pd_engine_submit(a->engine, &er, &err);  // the engine owns er.ctl on success
            if (st) pd_api_idmap_del(&a->ids, er.id);
        } else {
            snprintf(err.msg, sizeof err.msg, "out of memory");
        }
        if (st) pd_sample_ctl_free(er.ctl);
        if (st) {
            e->status = st;
            e->param[0] = 0;
            e->code = NULL;
            snprintf(e->message, sizeof e->message, "%s",
                     st == PD_NOSPACE ? "the server is overloaded (request queue full); retry later" : err.msg);
            return st;
        }
        c->id = er.id;
        c->is_live = true;
    }
    return PD_OK;
}

// Parsing, templating and tokenizing run on the preparation pool (prep.c); these continue on the
// loop thread with the result.
static void generate_prepared(api_prep_job *pj, void *ud) {
    pd_api *a = ud;
    pd_http_req *r = pj->http;
    pd_api_error e = pj->e;
    if (pj->status) {
        reply_api_error(r, &e);
        return;
    }
    pd_grammar *g = NULL;
    if (pd_api_constraint(a, &pj->rq, &g, &e)) {  // response_format / grammar / forced tool calls
        reply_api_error(r, &e);
        return;
    }
    api_job *j = job_new(a, r, &pj->rq, &pj->pr);
    if (!j) {
        e.status = PD_ERR_NOMEM;
        snprintf(e.message, sizeof e.message, "out of memory");
        reply_api_error(r, &e);
    } else if (job_submit(j, &pj->rq, &pj->pr, g, &e)) {
        j->http = NULL;
        pd_api_job_free(j);  // aborts what was queued
        reply_api_error(r, &e);
    } else {
        pd_http_req_set_close_cb(r, on_client_close, j);
        if (j->stream) pd_api_job_stream_begin(j);
    }
    pd_grammar_unref(g);  // the choices' matchers hold their own references
}

static void submit_prep(pd_http_req *r, pd_api *a, pd_api_kind kind, bool detect_kind, api_prep_done_fn done) {
    if (pd_api_prep_submit(a->prep, r, kind, detect_kind, done, a) != PD_OK)
        pd_http_reply_error(r, 500, "server_error", "out of memory", NULL, NULL);
}

static void handle_generate(pd_http_req *r, pd_api *a, pd_api_kind kind) {
    submit_prep(r, a, kind, false, generate_prepared);
}

static void h_completions(pd_http_req *r, void *ud) { handle_generate(r, ud, PD_API_COMPLETION); }

// POST /internal/tokenize (for the router): a completions or chat body (chat when it has
// "messages") → {"token_ids": [...]}, the ids the engine would get (the first prompt of a batch).
static void tokenize_prepared(api_prep_job *pj, void *ud) {
    pd_http_req *r = pj->http;
    PD_UNUSED(ud);
    if (pj->status) {
        reply_api_error(r, &pj->e);
        return;
    }
    json_t *ids = json_array();
    for (int i = 0; ids && i < pj->pr.items[0].n; i++) json_array_append_new(ids, json_integer(pj->pr.items[0].ids[i]));
    json_t *o = ids ? json_pack("{s:o}", "token_ids", ids) : NULL;
    if (o) pd_http_reply_json(r, 200, o);
    else pd_http_reply_error(r, 500, "server_error", "out of memory", NULL, NULL);
    json_decref(o);
}

static void h_tokenize(pd_http_req *r, void *ud) { submit_prep(r, ud, PD_API_COMPLETION, true, tokenize_prepared); }

json_t *pd_api_state_json(pd_api *a, uint64_t since, int max_events) {
    pd_wire_state st;
    pd_status s = pd_engine_state(a->engine, since, max_events, &st);
    st.load.n_ttft = a->n_ttft;
    for (int i = 0; i < PD_WIRE_N_TTFT_PARTS; i++) st.load.ttft_ms_sum[i] = a->ttft_ms_sum[i];
    json_t *o = s == PD_OK ? pd_wire_state_to_json(&st) : NULL;
    pd_wire_role role = st.role;
    pd_wire_state_fini(&st);
    if (o && role != PD_WIRE_ROLE_PREFILL) {  // the link-aware model (wire/link.h), for routers
        pd_disagg_model m;
        pd_engine_disagg_model(a->engine, &m);
        // (flip points searched up to 64k tokens: the scan runs on the loop, every presence)
        json_t *d = pd_disagg_model_to_json(&m, PD_MIN(a->max_model_len, 1 << 16));
        if (d) json_object_set_new(o, "disagg_model", d);
    }
    return o;
}

// GET /internal/state?since=N (for the router): load report + KV events (wire/control.h STATE).
static void h_state(pd_http_req *r, void *ud) {
    pd_api *a = ud;
    const char *q = pd_http_req_query(r, "since");
    char *end = NULL;
    unsigned long long since = q ? strtoull(q, &end, 10) : 0;
    if (q && (!*q || *end)) {
        pd_http_reply_error(r, 400, "invalid_request_error", "'since' must be a non-negative integer", "since", NULL);
        return;
    }
    json_t *o = pd_api_state_json(a, (uint64_t)since, 4096);
    char *txt = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!txt) pd_http_reply_error(r, 500, "server_error", "out of memory", NULL, NULL);
    else pd_http_reply(r, 200, "application/json", txt, strlen(txt));
    free(txt);
}
static void h_chat(pd_http_req *r, void *ud) { handle_generate(r, ud, PD_API_CHAT); }

static void h_health(pd_http_req *r, void *ud) {
    pd_api *a = ud;
    if (pd_http_server_is_draining(a->http))  // shutting down: load balancers take us out
        pd_http_reply(r, 503, "application/json", "{\"status\":\"draining\"}", 21);
    else
        pd_http_reply(r, 200, "application/json", "{\"status\":\"ok\"}", 15);
}

static void h_models(pd_http_req *r, void *ud) {
    pd_api *a = ud;
    json_t *o = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:i}]}", "object", "list", "data", "id", a->model_name, "object",
                          "model", "created", (json_int_t)time(NULL), "owned_by", "pdserve", "max_model_len",
                          a->max_model_len);
    if (!o) {
        pd_http_reply_error(r, 500, "server_error", "out of memory", NULL, NULL);
        return;
    }
    pd_http_reply_json(r, 200, o);
    json_decref(o);
}

// Counters mirrored from the engine's running totals: add the difference.
static void mirror(pd_metric *c, double total) {
    double d = total - pd_metric_value(c);
    if (d > 0) pd_metric_inc(c, d);
}

// The KV connector's counters: name, help (the order of pd_engine_stats' n_kv_auth_failures..).
static const char *const KVCONN_METRICS[8][2] = {
    {"pdserve_kv_auth_failures_total", "KV peers that did not prove the shared secret (disconnected, told nothing)."},
    {"pdserve_kv_protocol_errors_total", "KV connections closed for a malformed or out-of-bounds frame."},
    {"pdserve_kv_connections_accepted_total", "KV connections accepted by this prefill worker."},
    {"pdserve_kv_slow_peer_drops_total", "KV sends refused or connections closed because the peer did not read."},
    {"pdserve_kv_fenced_total", "KV loads failed only after their writer was fenced off."},
    {"pdserve_kv_peers_refused_total", "Decode KV pools refused (announced size or handle did not check out)."},
    {"pdserve_kv_saves_layerwise_total", "KV exports whose layers shipped while later layers computed."},
    {"pdserve_kv_saves_failed_total", "KV prefill requests refused or failed (PREFILL_FAIL sent)."},
};

// The KV tiers' metrics, one series per tier (label tier="dram|disk|redis").
static const char *const TIER_COUNTERS[7][2] = {
    {"pdserve_kv_tier_hits_total", "Block lookups a KV tier served."},
    {"pdserve_kv_tier_misses_total", "Block lookups a KV tier could not serve (absent, bad page, or the tier down)."},
    {"pdserve_kv_tier_puts_total", "Blocks written to a KV tier."},
    {"pdserve_kv_tier_evictions_total", "Blocks a KV tier evicted to respect its capacity."},
    {"pdserve_kv_tier_bad_pages_total", "Pages a KV tier refused on read (checksum, truncated, foreign): recomputed."},
    {"pdserve_kv_tier_bytes_in_total", "Bytes written to a KV tier."},
    {"pdserve_kv_tier_bytes_out_total", "Bytes read back from a KV tier."},
};
static const char *const TIER_GAUGES[3][2] = {
    {"pdserve_kv_tier_bytes_used", "Bytes a KV tier holds (Redis: 0, its memory is the server's)."},
    {"pdserve_kv_tier_capacity_bytes", "A KV tier's byte capacity."},
    {"pdserve_kv_tier_blocks", "Blocks a KV tier holds."},
};
static const double TIER_LOAD_BOUNDS[] = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1};

static void refresh_tier_metrics(pd_api *a, const pd_engine_stats *s) {
    api_metrics *x = &a->m;
    if (s->n_tiers <= 0) return;
    if (!x->has_tier_metrics) {
        pd_metrics *m = a->metrics;
        for (int t = 0; t < s->n_tiers; t++) {
            char l[48];
            snprintf(l, sizeof l, "tier=\"%s\"", s->tiers[t].name);
            for (int i = 0; i < 7; i++) x->tier_c[t][i] = pd_metrics_counter(m, TIER_COUNTERS[i][0], t ? "" : TIER_COUNTERS[i][1], l, NULL);
            for (int i = 0; i < 3; i++) x->tier_g[t][i] = pd_metrics_gauge(m, TIER_GAUGES[i][0], t ? "" : TIER_GAUGES[i][1], l, NULL);
            x->tier_load[t] = pd_metrics_histogram(m, "pdserve_kv_tier_load_seconds",
                                                   t ? "" : "Time to read, verify and decode one block from a KV tier.", l,
                                                   TIER_LOAD_BOUNDS, (int)PD_ARRAY_LEN(TIER_LOAD_BOUNDS), NULL);
        }
        x->tier_hit_tokens = pd_metrics_counter(m, "pdserve_kv_tier_hit_tokens_total",
                                                "Prompt tokens loaded from a KV tier instead of computed.", NULL, NULL);
        x->tier_offloads = pd_metrics_counter(m, "pdserve_kv_tier_offloads_total", "Blocks offered to the KV tiers (write-back).", NULL, NULL);
        x->tier_offloads_dropped = pd_metrics_counter(m, "pdserve_kv_tier_offloads_dropped_total",
                                                      "Blocks not offloaded: the tier queue was full.", NULL, NULL);
        x->tier_promotions = pd_metrics_counter(m, "pdserve_kv_tier_promotions_total",
                                                "Blocks loaded from a lower tier and copied into host DRAM.", NULL, NULL);
        x->tier_load_wall = pd_metrics_counter(m, "pdserve_kv_tier_load_wall_seconds_total",
                                               "Seconds of tier loads, each from its start to the blocks being ready "
                                               "(summed over loads; with pdserve_kv_tier_hit_tokens_total: the load bandwidth).",
                                               NULL, NULL);
        bool has_redis = false;
        for (int t = 0; t < s->n_tiers; t++) has_redis = has_redis || !strcmp(s->tiers[t].name, "redis");
        static const char *const k_removed[3] = {"reason=\"evicted\"", "reason=\"expired\"", "reason=\"deleted\""};
        for (int i = 0; i < 3 && has_redis; i++)
            x->tier_remote_notify[i] =
                pd_metrics_counter(m, "pdserve_kv_tier_redis_removed_total",
                                   i ? "" : "Pool pages Redis removed itself (keyspace notifications), reported to routers.",
                                   k_removed[i], NULL);
        if (has_redis) {
            x->tier_remote_notify[3] = pd_metrics_counter(
                m, "pdserve_kv_tier_redis_notifications_ignored_total",
                "Redis notification messages ignored: malformed, another model's key, a bad hash, oversized.", NULL, NULL);
            x->tier_remote_notify[4] = pd_metrics_counter(
                m, "pdserve_kv_tier_redis_notify_config_refused_total",
                "CONFIG SET notify-keyspace-events refused by the Redis server (evictions then go unreported).", NULL, NULL);
        }
        x->has_tier_metrics = true;
    }
    for (int t = 0; t < s->n_tiers; t++) {
        const pd_engine_tier_stats *ts = &s->tiers[t];
        int64_t c[7] = {ts->hits, ts->misses, ts->puts, ts->evictions, ts->bad_pages, ts->bytes_in, ts->bytes_out};
        for (int i = 0; i < 7; i++)
            if (x->tier_c[t][i]) mirror(x->tier_c[t][i], (double)c[i]);
        double g[3] = {(double)ts->bytes_used, (double)ts->capacity, (double)ts->n_items};
        for (int i = 0; i < 3; i++)
            if (x->tier_g[t][i]) pd_metric_set(x->tier_g[t][i], g[i]);
        // Bucket i holds loads of [2^(i-1), 2^i) us: observed at 1.5 x 2^(i-1) us.
        for (int i = 0; i < 24 && x->tier_load[t]; i++)
            for (; x->tier_hist_seen[t][i] < ts->load_hist[i]; x->tier_hist_seen[t][i]++)
                pd_metric_observe(x->tier_load[t], i ? 1.5e-6 * (double)(1 << (i - 1)) : 5e-7);
    }
    if (x->tier_hit_tokens) mirror(x->tier_hit_tokens, (double)s->n_tier_hit_tokens);
    if (x->tier_offloads) mirror(x->tier_offloads, (double)s->tier_offloads);
    if (x->tier_offloads_dropped) mirror(x->tier_offloads_dropped, (double)s->tier_offloads_dropped);
    if (x->tier_promotions) mirror(x->tier_promotions, (double)s->tier_promotions);
    if (x->tier_load_wall) mirror(x->tier_load_wall, (double)s->tier_load_us_total * 1e-6);
    for (int i = 0; i < 5; i++)
        if (x->tier_remote_notify[i]) mirror(x->tier_remote_notify[i], (double)s->tier_remote_notify[i]);
}

// The link-aware model (wire/link.h): the local step-time model and, per prefill link, its
// measured latency, bandwidth and the prompt length from which a handoff wins (gauges made on
// first sight of a link).
static void link_gauge(pd_api *a, const char *name, const char *help, const char *peer, double v) {
    char l[PD_LINK_PEER_MAX + 16];
    snprintf(l, sizeof l, "peer=\"%s\"", peer);
    pd_metric *g = pd_metrics_find(a->metrics, name, l);
    if (!g) g = pd_metrics_gauge(a->metrics, name, help, l, NULL);
    if (g) pd_metric_set(g, v);
}

static void link_metrics(pd_api *a) {
    pd_disagg_model m;
    pd_engine_disagg_model(a->engine, &m);
    pd_metric_set(a->m.local_a, m.local_a_us / 1e6);
    pd_metric_set(a->m.local_b, m.local_b_us / 1e6);
    for (int i = 0; i < m.n_links; i++) {
        const pd_link_stats *l = &m.links[i];
        link_gauge(a, "pdserve_kv_link_rtt_seconds", "Measured round trip to a prefill worker (-1e-6: unknown).", l->peer,
                   l->rtt_us / 1e6);
        link_gauge(a, "pdserve_kv_link_bandwidth_bytes_per_second",
                   "Measured KV bandwidth from a prefill worker (probe at connect, then real transfers; -1 unknown).",
                   l->peer, l->bw_bytes_per_s);
        link_gauge(a, "pdserve_kv_link_flip_tokens",
                   "Shortest prompt the model hands off over this link (-1: none up to the context length).", l->peer,
                   (double)pd_disagg_flip_tokens(&m, i, PD_MIN(a->max_model_len, 1 << 16)));
        link_gauge(a, "pdserve_kv_link_remote_prefill_seconds_per_token",
                   "The prefill worker's measured compute per prompt token (-1e-6: unknown).", l->peer, l->remote_b_us / 1e6);
    }
}

static void refresh_engine_metrics(pd_api *a) {
    pd_engine_stats s;
    memset(&s, 0, sizeof s);
    pd_engine_stats_get(a->engine, &s);
    pd_metric_set(a->m.running, s.n_running);
    pd_metric_set(a->m.waiting, s.n_waiting);
    pd_metric_set(a->m.kv_total, s.n_blocks_total);
    pd_metric_set(a->m.kv_free, s.n_blocks_free);
    pd_metric_set(a->m.kv_used, s.n_blocks_used);
    pd_metric_set(a->m.kv_cached, s.n_blocks_cached);
    pd_metric_set(a->m.kv_usage, s.n_blocks_total ? (double)s.n_blocks_used / s.n_blocks_total : 0);
    mirror(a->m.prefix_queries, s.n_prefix_query_tokens);
    mirror(a->m.prefix_hits, s.n_prefix_hit_tokens);
    pd_metric_set(a->m.prefix_hit_rate,
                  s.n_prefix_query_tokens ? (double)s.n_prefix_hit_tokens / (double)s.n_prefix_query_tokens : 0);
    mirror(a->m.prompt_tokens, s.n_prompt_tokens);
    mirror(a->m.gen_tokens, s.n_generation_tokens);
    mirror(a->m.prefill_computed, s.n_prefill_tokens_computed);
    mirror(a->m.preemptions, s.n_preemptions);
    mirror(a->m.steps, s.n_steps);
    pd_metric_set(a->m.jobs, a->n_jobs);
    mirror(a->m.handoffs, s.n_kv_handoffs);
    for (int i = 0; i < PD_FALLBACK_N; i++) mirror(a->m.fallbacks[i], s.n_kv_fallbacks[i]);
    mirror(a->m.local_short, s.n_kv_local_short);
    mirror(a->m.handoff_bytes, s.n_kv_handoff_bytes);
    mirror(a->m.handoff_seconds, (double)s.kv_handoff_us_total / 1e6);
    mirror(a->m.exports, s.n_kv_exports);
    mirror(a->m.export_bytes, s.n_kv_export_bytes);
    mirror(a->m.export_copy_seconds, (double)s.kv_export_copy_us_total / 1e6);
    pd_metric_set(a->m.prefill_healthy, pd_engine_n_prefill_healthy(a->engine));
    mirror(a->m.decide_local, s.n_disagg_decide_local);
    mirror(a->m.decide_remote, s.n_disagg_decide_remote);
    link_metrics(a);
    int64_t kvc[8] = {s.n_kv_auth_failures, s.n_kv_proto_errors, s.n_kv_conns_accepted, s.n_kv_slow_peer_drops,
                      s.n_kv_fenced, s.n_kv_peers_refused, s.n_kv_saves_layerwise, s.n_kv_saves_failed};
    for (int i = 0; i < 8; i++) mirror(a->m.kvconn[i], (double)kvc[i]);
    for (int k = 1; k < PD_ENGINE_SPEC_N; k++) {
        mirror(a->m.spec_drafted[k], s.spec_drafted[k]);
        mirror(a->m.spec_accepted[k], s.spec_accepted[k]);
        mirror(a->m.spec_emitted[k], s.spec_emitted[k]);
        mirror(a->m.spec_steps[k], s.spec_steps[k]);
        pd_metric_set(a->m.spec_rate[k], s.spec_drafted[k] ? (double)s.spec_accepted[k] / (double)s.spec_drafted[k] : 0);
        pd_metric_set(a->m.spec_mal[k], s.spec_steps[k] ? (double)s.spec_emitted[k] / (double)s.spec_steps[k] : 0);
    }
    double mask_s, n_masks;
    pd_api_mask_stats(&mask_s, &n_masks);
    mirror(a->m.masks, n_masks);
    mirror(a->m.mask_seconds, mask_s);
    refresh_tier_metrics(a, &s);
}

static void h_metrics(pd_http_req *r, void *ud) {
    pd_api *a = ud;
    refresh_engine_metrics(a);
    char *txt = NULL;
    size_t n = 0;
    if (pd_metrics_render(a->metrics, &txt, &n)) {
        pd_http_reply_error(r, 500, "server_error", "out of memory", NULL, NULL);
        return;
    }
    pd_http_reply(r, 200, "text/plain; version=0.0.4; charset=utf-8", txt, n);
    pd_free(txt);
}

// Responses by status: one counter per status code, registered on first sight.
static void on_response(int status, void *ud) {
    pd_api *a = ud;
    char labels[32];
    snprintf(labels, sizeof labels, "status=\"%d\"", status);
    pd_metric *c = pd_metrics_find(a->metrics, "pdserve_http_responses_total", labels);
    if (!c) c = pd_metrics_counter(a->metrics, "pdserve_http_responses_total", "HTTP responses by status code.", labels, NULL);
    pd_metric_inc(c, 1);
}

static void on_engine_fd(evutil_socket_t fd, short what, void *arg) {
    pd_api *a = arg;
    PD_UNUSED(fd);
    PD_UNUSED(what);
    pd_engine_event evs[64];
    int n;
    do {
        n = pd_engine_poll(a->engine, evs, (int)PD_ARRAY_LEN(evs));
        for (int i = 0; i < n; i++) pd_api_job_on_event(a, &evs[i]);
    } while (n == (int)PD_ARRAY_LEN(evs));
}

// ---- metrics registration ----------------------------------------------------------------------

static pd_status register_metrics(pd_api *a, pd_err *err) {
    pd_metrics *m = a->metrics;
    api_metrics *x = &a->m;
#define H(f, name, help, b, nb) if (!(x->f = pd_metrics_histogram(m, name, help, NULL, b, nb, err))) return err ? err->status : PD_ERR_NOMEM
#define G(f, name, help) if (!(x->f = pd_metrics_gauge(m, name, help, NULL, err))) return err ? err->status : PD_ERR_NOMEM
#define G2(f, name, help, l) if (!(x->f = pd_metrics_gauge(m, name, help, l, err))) return err ? err->status : PD_ERR_NOMEM
#define C(f, name, help, l) if (!(x->f = pd_metrics_counter(m, name, help, l, err))) return err ? err->status : PD_ERR_NOMEM
    H(ttft, "pdserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
      pd_metrics_latency_buckets, pd_metrics_n_latency_buckets);
    H(itl, "pdserve_inter_token_latency_seconds", "Time between consecutive generated tokens of a sequence.",
      pd_metrics_itl_buckets, pd_metrics_n_itl_buckets);
    H(e2e, "pdserve_e2e_request_latency_seconds", "Time from arrival to the last token of a request.",
      pd_metrics_latency_buckets, pd_metrics_n_latency_buckets);
    G(running, "pdserve_num_requests_running", "Sequences in the running batch.");
    G(waiting, "pdserve_num_requests_waiting", "Sequences waiting to be scheduled.");
    G(jobs, "pdserve_http_requests_in_flight", "HTTP generation requests being served.");
    G(kv_total, "pdserve_kv_blocks_total", "KV cache blocks in the pool.");
    G(kv_free, "pdserve_kv_blocks_free", "KV cache blocks free (prefix-cached blocks count as free).");
    G(kv_used, "pdserve_kv_blocks_used", "KV cache blocks held by requests.");
    G(kv_cached, "pdserve_kv_blocks_cached", "Free KV cache blocks that still hold a cached prefix.");
    G(kv_usage, "pdserve_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests.");
    C(prefix_queries, "pdserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", NULL);
    C(prefix_hits, "pdserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", NULL);
    G(prefix_hit_rate, "pdserve_prefix_cache_hit_rate", "Prefix cache hits / queries since start (tokens).");
    C(prompt_tokens, "pdserve_prompt_tokens_total", "Prompt tokens of admitted requests.", NULL);
    C(gen_tokens, "pdserve_generation_tokens_total", "Generated tokens.", NULL);
    C(prefill_computed, "pdserve_prefill_tokens_computed_total", "Prompt tokens run through the model.", NULL);
    C(preemptions, "pdserve_num_preemptions_total", "Sequences preempted for lack of KV blocks.", NULL);
    C(steps, "pdserve_engine_steps_total", "Engine steps executed.", NULL);
    C(fin_stop, "pdserve_request_success_total", "Finished sequences by finish reason.", "finish_reason=\"stop\"");
    C(fin_length, "pdserve_request_success_total", "", "finish_reason=\"length\"");
    C(fin_abort, "pdserve_request_success_total", "", "finish_reason=\"abort\"");
    C(fin_error, "pdserve_request_success_total", "", "finish_reason=\"error\"");
    // Disaggregation (zero on a colocated worker).
    C(handoffs, "pdserve_kv_handoffs_total", "Prompts whose KV came from a prefill worker.", NULL);
    for (int i = 0; i < PD_FALLBACK_N; i++) {
        char l[64];
        snprintf(l, sizeof l, "reason=\"%s\"", pd_fallback_reason_name((pd_fallback_reason)i));
        C(fallbacks[i], "pdserve_kv_handoff_fallbacks_total", "Prompts prefilled locally after a failed KV handoff.", l);
    }
    C(local_short, "pdserve_kv_local_prefill_short_total", "Prompts prefilled locally because the uncached part was short.", NULL);
    C(handoff_bytes, "pdserve_kv_handoff_bytes_total", "KV bytes received from prefill workers.", NULL);
    C(handoff_seconds, "pdserve_kv_handoff_seconds_total", "Time from KV request to verified KV, summed over handoffs.", NULL);
    C(exports, "pdserve_kv_exports_total", "Prompts whose KV this prefill worker exported.", NULL);
    C(export_bytes, "pdserve_kv_export_bytes_total", "KV bytes this prefill worker wrote into decode pools.", NULL);
    C(export_copy_seconds, "pdserve_kv_export_copy_seconds_total", "Time spent copying exported KV, summed.", NULL);
    G(prefill_healthy, "pdserve_kv_prefill_workers_healthy", "Prefill workers this decode worker is connected to.");
    C(decide_local, "pdserve_disagg_decisions_total", "Link-aware local/remote prefill decisions (prompts above --disagg-min-tokens).",
      "decision=\"local\"");
    C(decide_remote, "pdserve_disagg_decisions_total", "", "decision=\"remote\"");
    G(local_a, "pdserve_disagg_local_step_seconds", "The step-time model's fixed cost per step (-1e-6: unknown).");
    G(local_b, "pdserve_disagg_local_token_seconds", "The step-time model's cost per token (-1e-6: unknown).");
    for (int i = 0; i < 8; i++) C(kvconn[i], KVCONN_METRICS[i][0], KVCONN_METRICS[i][1], NULL);
    // Speculative decoding, by method (zero without it).
    for (int k = 1; k < PD_ENGINE_SPEC_N; k++) {
        char l[64];
        bool first = k == 1;
        snprintf(l, sizeof l, "method=\"%s\"", pd_engine_spec_method_name(k));
        C(spec_drafted[k], "pdserve_spec_draft_tokens_total", first ? "Draft tokens verified by the target." : "", l);
        C(spec_accepted[k], "pdserve_spec_accepted_tokens_total", first ? "Draft tokens accepted." : "", l);
        C(spec_emitted[k], "pdserve_spec_emitted_tokens_total",
          first ? "Tokens emitted by verify steps (accepted drafts plus the target's own token)." : "", l);
        C(spec_steps[k], "pdserve_spec_verify_steps_total", first ? "Sequence-steps that verified drafts." : "", l);
        G2(spec_rate[k], "pdserve_spec_acceptance_rate", first ? "Accepted / drafted tokens since start." : "", l);
        G2(spec_mal[k], "pdserve_spec_mean_accepted_length", first ? "Tokens emitted per verify step since start." : "", l);
    }
    C(masks, "pdserve_grammar_masks_total", "Token masks computed for constrained decoding (one per constrained row and step).", NULL);
    C(mask_seconds, "pdserve_grammar_mask_seconds_total", "CPU time spent computing token masks, summed.", NULL);
#undef H
#undef G2
#undef G
#undef C
    return PD_OK;
}

// ---- lifecycle ---------------------------------------------------------------------------------

pd_api_params pd_api_params_default(void) {
    pd_api_params p = {0};
    p.host = "127.0.0.1";
    p.max_body_bytes = (size_t)8 << 20;
    return p;
}

pd_api *pd_api_new(struct event_base *base, pd_engine *e, const pd_api_params *p, pd_err *err) {
    pd_api_params d = pd_api_params_default();
    if (!p) p = &d;
    pd_api *a = pd_calloc(1, sizeof *a);
    if (!a) {
        pd_err_set(err, PD_ERR_NOMEM, "api: out of memory");
        return NULL;
    }
    a->base = base;
    a->engine = e;
    a->tok = pd_engine_tok(e);
    a->max_model_len = pd_engine_max_model_len(e);
    pd_rng_seed(&a->rng, (uint64_t)pd_time_us() ^ (uint64_t)time(NULL));
    a->model_name = pd_strdup(p->served_model_name && *p->served_model_name ? p->served_model_name
                                                                            : pd_engine_model_name(e));
    a->metrics = pd_metrics_new();
    if (!a->model_name || !a->metrics) {
        pd_err_set(err, PD_ERR_NOMEM, "api: out of memory");
        goto fail;
    }
    const char *tmpl = pd_tok_chat_template(a->tok);
    if (tmpl) {
        pd_err terr = {0};
        a->tmpl = pd_chat_template_new(tmpl, strlen(tmpl), pd_tok_bos_token(a->tok), pd_tok_eos_token(a->tok), &terr);
        if (!a->tmpl) {
            pd_err_set(err, terr.status ? terr.status : PD_ERR_INVALID, "chat template: %s", terr.msg);
            goto fail;
        }
    }
    if (register_metrics(a, err) || pd_api_timing_metrics_init(a, err)) goto fail;
    // Constrained decoding: the vocabulary trie, the tool-call syntax, the tokens that end a sequence.
    pd_err gerr = {0};
    a->gvocab = pd_grammar_vocab_new(a->tok, &gerr);
    if (!a->gvocab) PD_LOG_W("api: no constrained decoding: %s", gerr.msg);
    a->tool_fmt = pd_api_tool_format_detect(tmpl);
    const pd_model_config *cfg = pd_engine_config(e);
    for (int i = 0; i < cfg->n_eos && a->n_end_ids < 15; i++) a->end_ids[a->n_end_ids++] = cfg->eos_token_ids[i];
    if (pd_tok_eos_id(a->tok) >= 0) a->end_ids[a->n_end_ids++] = pd_tok_eos_id(a->tok);
    a->prep = pd_api_prep_new(base, &(pd_api_prep_params){.tok = a->tok, .tmpl = a->tmpl, .model_name = a->model_name,
                                                          .max_model_len = a->max_model_len, .tool_format = a->tool_fmt}, err);
    if (!a->prep) goto fail;
    pd_http_params hp = pd_http_params_default();
    hp.host = p->host;
    hp.port = p->port;
    if (p->max_body_bytes) hp.max_body_bytes = p->max_body_bytes;
    if (p->max_connections > 0) hp.max_connections = p->max_connections;
    if (p->keepalive_timeout_s > 0) hp.keepalive_timeout_s = p->keepalive_timeout_s;
    if (p->header_timeout_s > 0) hp.header_timeout_s = p->header_timeout_s;
    hp.on_response = on_response;
    hp.on_response_ud = a;
    a->http = pd_http_server_new(base, &hp, err);
    if (!a->http) goto fail;
    if (pd_http_server_route(a->http, "POST", "/v1/completions", h_completions, a) ||
        pd_http_server_route(a->http, "POST", "/v1/chat/completions", h_chat, a) ||
        pd_http_server_route(a->http, "GET", "/v1/models", h_models, a) ||
        pd_http_server_route(a->http, "GET", "/health", h_health, a) ||
        pd_http_server_route(a->http, "GET", "/metrics", h_metrics, a) ||
        pd_http_server_route(a->http, "POST", "/internal/tokenize", h_tokenize, a) ||
        pd_http_server_route(a->http, "GET", "/internal/state", h_state, a)) {
        pd_err_set(err, PD_ERR_NOMEM, "api: cannot add routes");
        goto fail;
    }
    a->ev_engine = event_new(base, pd_engine_event_fd(e), EV_READ | EV_PERSIST, on_engine_fd, a);
    if (!a->ev_engine || event_add(a->ev_engine, NULL)) {
        pd_err_set(err, PD_ERR_IO, "api: cannot watch the engine event fd");
        goto fail;
    }
    return a;
fail:
    pd_api_free(a);
    return NULL;
}

void pd_api_free(pd_api *a) {
    if (!a) return;
    if (a->ev_engine) event_free(a->ev_engine);
    // Closing the server runs on_client_close for every held request: their jobs are cancelled.
    pd_http_server_free(a->http);
    pd_api_prep_free(a->prep);  // after the server: requests still being prepared were cancelled
    while (a->jobs) pd_api_job_cancel(a->jobs);
    pd_api_idmap_fini(&a->ids);
    pd_api_gcache_fini(a);
    pd_grammar_vocab_free(a->gvocab);
    pd_chat_template_free(a->tmpl);
    pd_metrics_free(a->metrics);
    pd_free(a->model_name);
    pd_free(a);
}

int pd_api_port(const pd_api *a) { return pd_http_server_port(a->http); }
const char *pd_api_model_name(const pd_api *a) { return a->model_name; }
void pd_api_stop_accepting(pd_api *a) { pd_http_server_stop_accepting(a->http); }
void pd_api_drain(pd_api *a, int retry_after_s) { pd_http_server_drain(a->http, retry_after_s); }
int pd_api_n_jobs(const pd_api *a) { return a->n_jobs + pd_api_prep_n_pending(a->prep); }
bool pd_api_is_drained(pd_api *a) {
    return pd_api_n_jobs(a) == 0 && pd_http_server_n_active(a->http) == 0 && pd_http_server_n_unflushed(a->http) == 0;
}
// The close callbacks (on_client_close) cancel the jobs and abort their engine requests.
void pd_api_end_all(pd_api *a, const char *msg) { pd_http_server_end_all(a->http, msg); }
int pd_api_n_engine_requests(const pd_api *a) { return (int)pd_map_len(&a->ids.map); }
