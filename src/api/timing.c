// timing.c — the worker's time-to-first-token breakdown and its request spans.
//
// The engine stamps the first TOKEN event of a request (engine.h, pd_engine_event) with when its
// prompt started computing (or its PREFILL_REQ left), when the prompt's KV was complete (or
// verified after a handoff) and, after a handoff, the prefill worker's own queue and compute
// times. From those and the job's arrival this file splits the TTFT the client sees into
//   queue         arrival → prefill starts (plus, remote, the prefill worker's queue)
//   prefill       the prompt's forward: local steps, or the prefill worker's compute time
//   transfer      remote only: handoff time not spent computing (request, KV copy, checksums)
//   first_decode  KV complete → first token handed to the HTTP loop
// so the four parts add up to the TTFT. Each part is a Prometheus histogram
// (pdserve_ttft_part_seconds{part,prefill="local|remote"}), a running sum for the router
// (GET /internal/state, load.ttft) and, when the request asks for it ("timings": true or
// stream_options.include_timings), usage.ttft_breakdown. With tracing on (metrics/trace.h) the
// job's span and one child span per part are exported when the job completes.
#include <stdio.h>
#include <string.h>

#include "api/api_impl.h"
#include "metrics/trace.h"

pd_status pd_api_timing_metrics_init(pd_api *a, pd_err *err) {
    for (int p = 0; p < PD_WIRE_N_TTFT_PARTS; p++)
        for (int r = 0; r < 2; r++) {
            char l[64];
            snprintf(l, sizeof l, "part=\"%s\",prefill=\"%s\"", pd_wire_ttft_part_names[p], r ? "remote" : "local");
            a->m.ttft_part[p][r] = pd_metrics_histogram(a->metrics, "pdserve_ttft_part_seconds",
                                                       "Time to first token split into queue, prefill, transfer and first decode",
                                                       l, pd_metrics_latency_buckets, pd_metrics_n_latency_buckets, err);
            if (!a->m.ttft_part[p][r]) return err ? err->status : PD_ERR_NOMEM;
        }
    return PD_OK;
}

void pd_api_ttft_note(api_job *j, const pd_engine_event *ev, int64_t now) {
    if (j->has_ttft) return;  // the first choice's first token stands for the request
    pd_api *a = j->api;
    int64_t t_arr = j->t_arrival_us;
    int64_t t_sched = ev->t_sched_us > 0 ? PD_MAX(ev->t_sched_us, t_arr) : now;
    int64_t t_kv = ev->t_kv_ready_us > 0 ? PD_MAX(ev->t_kv_ready_us, t_sched) : t_sched;
    if (t_kv > now) t_kv = now;
    double q = (double)(t_sched - t_arr), p, x = 0, f = (double)(now - t_kv);
    if (ev->is_remote_prefill) {
        double span = (double)(t_kv - t_sched), rq = (double)ev->remote_queue_us, rc = (double)ev->remote_compute_us;
        if (rq + rc > span) {  // clocks of two processes: never let the parts exceed the whole
            double k = span > 0 && rq + rc > 0 ? span / (rq + rc) : 0;
            rq *= k;
            rc *= k;
        }
        q += rq;
        p = rc;
        x = span - rq - rc;
    } else {
        p = (double)(t_kv - t_sched);
    }
    j->has_ttft = true;
    j->ttft_remote = ev->is_remote_prefill;
    j->ttft_ms[0] = q / 1e3, j->ttft_ms[1] = p / 1e3, j->ttft_ms[2] = x / 1e3, j->ttft_ms[3] = f / 1e3;
    j->t_ttft_sched_us = t_sched, j->t_ttft_kv_us = t_kv, j->t_ttft_first_us = now;
    a->n_ttft++;
    for (int i = 0; i < PD_WIRE_N_TTFT_PARTS; i++) {
        a->ttft_ms_sum[i] += j->ttft_ms[i];
        pd_metric_observe(a->m.ttft_part[i][j->ttft_remote], j->ttft_ms[i] / 1e3);
    }
}

json_t *pd_api_ttft_json(const api_job *j) {
    if (!j->has_ttft) return json_null();
    double total = 0;
    for (int i = 0; i < PD_WIRE_N_TTFT_PARTS; i++) total += j->ttft_ms[i];
    return json_pack("{s:f,s:f,s:f,s:f,s:f,s:s}", "queue_ms", j->ttft_ms[0], "prefill_ms", j->ttft_ms[1], "transfer_ms",
                     j->ttft_ms[2], "first_decode_ms", j->ttft_ms[3], "ttft_ms", total, "prefill",
                     j->ttft_remote ? "remote" : "local");
}

void pd_api_trace_begin(api_job *j, const char *traceparent) {
    if (!pd_trace_enabled()) return;
    pd_trace_ctx in;
    if (traceparent && pd_traceparent_parse(traceparent, &in) == PD_OK) {
        memcpy(j->trace_id, in.trace_id, 16);
        memcpy(j->parent_span_id, in.span_id, 8);
        j->has_parent_span = true;
    } else {
        pd_trace_new_trace_id(j->trace_id);
    }
    pd_trace_new_span_id(j->span_id);
    j->is_traced = true;
}

void pd_api_trace_traceparent(const api_job *j, char out[56]) {
    out[0] = 0;
    if (j->is_traced) pd_traceparent_format(j->trace_id, j->span_id, out);
}

void pd_api_trace_end(api_job *j, int64_t now) {
    if (!j->is_traced) return;
    char attrs[256];
    snprintf(attrs, sizeof attrs, "\"id\":\"%s\",\"prompt_tokens\":%d,\"choices\":%d,\"prefill\":\"%s\"", j->id,
             j->n_prompt_tokens, j->n_choices, j->has_ttft ? (j->ttft_remote ? "remote" : "local") : "none");
    pd_trace_span(j->trace_id, j->span_id, j->has_parent_span ? j->parent_span_id : NULL, "worker.request",
                  j->t_arrival_us, now, attrs);
    if (!j->has_ttft) return;
    int64_t t_first_q_end = j->t_ttft_sched_us;
    struct { const char *name; int64_t a, b; } parts[] = {
        {"queue", j->t_arrival_us, t_first_q_end},
        {j->ttft_remote ? "remote_prefill" : "prefill", j->t_ttft_sched_us, j->t_ttft_kv_us},
        {"first_decode", j->t_ttft_kv_us, j->t_ttft_first_us},
        {"decode", j->t_ttft_first_us, now},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(parts); i++) {
        uint8_t s[8];
        pd_trace_new_span_id(s);
        pd_trace_span(j->trace_id, s, j->span_id, parts[i].name, parts[i].a, parts[i].b, NULL);
    }
}
