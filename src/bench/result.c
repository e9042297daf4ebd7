// result.c — a benchmark's results as the --output-json document and as the human summary.
//
// JSON document (version PD_BENCH_JSON_VERSION; numbers that are undefined — NAN, an infinite
// request rate — are null):
//   {"pdserve_bench_version": 1, "label": "...",
//    "config": {"url", "endpoint", "dataset": {...}, "burstiness", "max_concurrency",
//               "request_timeout_s", "timeout_s", "seed", "num_warmups",
//               "goodput": {"ttft_ms", "tpot_ms", "e2e_ms"}},
//    "runs": [{"request_rate", "burstiness", "max_concurrency", "model",
//              "metrics": {"completed", "failed", "duration_s", "total_input_tokens",
//                          "total_output_tokens", "request_throughput", "output_throughput",
//                          "total_token_throughput", "good_requests", "goodput",
//                          "ttft_ms": DIST, "tpot_ms": DIST, "itl_ms": DIST, "e2e_ms": DIST},
//              "requests": [{"idx", "start_s", "ok", "http_status", "error", "prompt_tokens",
//                            "output_tokens", "chunks", "ttft_ms", "tpot_ms", "e2e_ms",
//                            "itl_ms": [...]}, ...]}, ...]}
//   DIST = {"n", "mean", "std", "min", "max", "median", "p90", "p99", "p99_9"}
// A sweep has one entry in "runs" per rate; `bench merge` takes several documents (one per
// configuration, told apart by "label").
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "bench/bench_impl.h"

static json_t *num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *dist_json(const pd_bench_dist *d) {
    return json_pack("{s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o}", "n", (json_int_t)d->n, "mean", num(d->mean),
                     "std", num(d->std), "min", num(d->min), "max", num(d->max), "median", num(d->median),
                     "p90", num(d->p90), "p99", num(d->p99), "p99_9", num(d->p999));
}

json_t *pd_bench_metrics_to_json(const pd_bench_metrics *m) {
    return json_pack("{s:i,s:i,s:o,s:I,s:I,s:o,s:o,s:o,s:i,s:o,s:o,s:o,s:o,s:o}", "completed", m->n_completed,
                     "failed", m->n_failed, "duration_s", num(m->duration_s), "total_input_tokens",
                     (json_int_t)m->n_input_tokens, "total_output_tokens", (json_int_t)m->n_output_tokens,
                     "request_throughput", num(m->request_throughput), "output_throughput",
                     num(m->output_throughput), "total_token_throughput", num(m->total_token_throughput),
                     "good_requests", m->n_good, "goodput", num(m->goodput), "ttft_ms", dist_json(&m->ttft_ms),
                     "tpot_ms", dist_json(&m->tpot_ms), "itl_ms", dist_json(&m->itl_ms), "e2e_ms",
                     dist_json(&m->e2e_ms));
}

static json_t *record_json(const pd_bench_record *r) {
    json_t *itl = json_array();
    for (int i = 0; itl && i < r->n_itl; i++)
        if (json_array_append_new(itl, json_real(r->itl_ms[i]))) {
            json_decref(itl);
            return NULL;
        }
    if (!itl) return NULL;
    return json_pack("{s:i,s:o,s:b,s:i,s:o,s:i,s:i,s:i,s:o,s:o,s:o,s:o}", "idx", r->idx, "start_s", num(r->start_s),
                     "ok", r->is_ok, "http_status", r->http_status, "error",
                     r->error ? json_string(r->error) : json_null(), "prompt_tokens", r->n_prompt_tokens,
                     "output_tokens", r->n_output_tokens, "chunks", r->n_chunks, "ttft_ms", num(r->ttft_ms),
                     "tpot_ms", num(r->tpot_ms), "e2e_ms", num(r->e2e_ms), "itl_ms", itl);
}

static json_t *run_json(const pd_bench_result *r) {
    json_t *reqs = json_array();
    for (int i = 0; reqs && i < r->n_records; i++)
        if (json_array_append_new(reqs, record_json(&r->records[i]))) {
            json_decref(reqs);
            return NULL;
        }
    if (!reqs) return NULL;
    return json_pack("{s:o,s:o,s:i,s:s?,s:o,s:o}", "request_rate", num(r->request_rate), "burstiness",
                     num(r->burstiness), "max_concurrency", r->max_concurrency, "model", r->model, "metrics",
                     pd_bench_metrics_to_json(&r->metrics), "requests", reqs);
}

static json_t *dataset_json(const pd_bench_dataset_params *d) {
    json_t *o = json_pack("{s:s,s:i,s:I,s:i,s:i}", "name", pd_bench_dataset_kind_name(d->kind), "num_prompts",
                          d->n_prompts, "seed", (json_int_t)d->seed, "token_id_min", d->token_id_min,
                          "token_id_max", d->token_id_max);
    if (!o) return NULL;
    json_t *extra = NULL;
    switch (d->kind) {
    case PD_BENCH_DATASET_RANDOM:
        extra = json_pack("{s:i,s:i,s:f}", "input_len", d->input_len, "output_len", d->output_len, "range_ratio",
                          d->range_ratio);
        break;
    case PD_BENCH_DATASET_SHARED_PREFIX:
        extra = json_pack("{s:i,s:i,s:i,s:i,s:f}", "prefix_len", d->prefix_len, "num_prefixes", d->n_prefixes,
                          "suffix_len", d->suffix_len, "output_len", d->output_len, "range_ratio", d->range_ratio);
        break;
    case PD_BENCH_DATASET_LONG_MIX:
        extra = json_pack("{s:f,s:i,s:i,s:i}", "long_fraction", d->long_fraction, "long_len", d->long_len,
                          "short_len", d->short_len, "output_len", d->output_len);
        break;
    case PD_BENCH_DATASET_TRACE:
        extra = json_pack("{s:s}", "trace", d->trace_path ? d->trace_path : "");
        break;
    }
    if (!extra || json_object_update(o, extra)) {
        json_decref(extra);
        json_decref(o);
        return NULL;
    }
    json_decref(extra);
    return o;
}

static json_t *config_json(const pd_bench_config *cfg) {
    const pd_bench_params *p = cfg->params;
    json_t *slo = json_pack("{s:o,s:o,s:o}", "ttft_ms", num(p->slo.ttft_ms > 0 ? p->slo.ttft_ms : NAN), "tpot_ms",
                            num(p->slo.tpot_ms > 0 ? p->slo.tpot_ms : NAN), "e2e_ms",
                            num(p->slo.e2e_ms > 0 ? p->slo.e2e_ms : NAN));
    // NOTE: the API key is deliberately left out: result files get shared.
    return json_pack("{s:s?,s:s?,s:o,s:o,s:i,s:o,s:o,s:I,s:i,s:o}", "url", p->base_url, "endpoint", p->endpoint,
                     "dataset", dataset_json(cfg->dataset), "burstiness", num(p->burstiness), "max_concurrency",
                     p->max_concurrency, "request_timeout_s", num(p->request_timeout_s), "timeout_s",
                     num(p->timeout_s), "seed", (json_int_t)p->seed, "num_warmups", p->n_warmup, "goodput", slo);
}

json_t *pd_bench_result_to_json(const pd_bench_config *cfg, pd_bench_result *const *runs, int n_runs) {
    json_t *arr = json_array();
    for (int i = 0; arr && i < n_runs; i++)
        if (json_array_append_new(arr, run_json(runs[i]))) {
            json_decref(arr);
            return NULL;
        }
    if (!arr) return NULL;
    return json_pack("{s:i,s:s,s:o,s:o}", "pdserve_bench_version", PD_BENCH_JSON_VERSION, "label",
                     cfg->label ? cfg->label : "pdserve", "config", config_json(cfg), "runs", arr);
}

pd_status pd_bench_result_check_json(const json_t *doc, pd_err *err) {
    json_t *v = json_object_get(doc, "pdserve_bench_version");
    if (!json_is_integer(v) || json_integer_value(v) != PD_BENCH_JSON_VERSION)
        return pd_err_set(err, PD_ERR_INVALID, "not a pdserve bench document (pdserve_bench_version %d expected)",
                          PD_BENCH_JSON_VERSION);
    json_t *runs = json_object_get(doc, "runs");
    if (!json_is_array(runs) || json_array_size(runs) == 0)
        return pd_err_set(err, PD_ERR_INVALID, "bench document without runs");
    size_t i;
    json_t *r;
    json_array_foreach(runs, i, r) {
        if (!json_is_object(json_object_get(r, "metrics")) || !json_is_array(json_object_get(r, "requests")))
            return pd_err_set(err, PD_ERR_INVALID, "bench document: run %zu lacks metrics or requests", i);
    }
    return PD_OK;
}

static double jnum(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

pd_status pd_bench_result_apply_slo(json_t *doc, const pd_bench_slo *slo, pd_err *err) {
    pd_status st = pd_bench_result_check_json(doc, err);
    if (st) return st;
    size_t i, j;
    json_t *run, *req;
    json_array_foreach(json_object_get(doc, "runs"), i, run) {
        json_t *m = json_object_get(run, "metrics");
        int n_good = 0;
        json_array_foreach(json_object_get(run, "requests"), j, req) {
            pd_bench_record r = {.is_ok = json_is_true(json_object_get(req, "ok")), .ttft_ms = jnum(req, "ttft_ms"),
                                 .tpot_ms = jnum(req, "tpot_ms"), .e2e_ms = jnum(req, "e2e_ms")};
            n_good += pd_bench_stats_meets_slo(slo, &r);
        }
        double d = jnum(m, "duration_s");
        if (json_object_set_new(m, "good_requests", json_integer(n_good)) ||
            json_object_set_new(m, "goodput", num(d > 0 ? n_good / d : NAN)))
            return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    }
    json_t *g = json_pack("{s:o,s:o,s:o}", "ttft_ms", num(slo->ttft_ms > 0 ? slo->ttft_ms : NAN), "tpot_ms",
                          num(slo->tpot_ms > 0 ? slo->tpot_ms : NAN), "e2e_ms", num(slo->e2e_ms > 0 ? slo->e2e_ms : NAN));
    json_t *cfg = json_object_get(doc, "config");
    if (!g || !json_is_object(cfg) || json_object_set_new(cfg, "goodput", g))
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    return PD_OK;
}

// ---- the human summary ---------------------------------------------------------------------------

static void row(pd_bench_buf *b, const char *name, double v, int prec) {
    if (isfinite(v)) pd_bench_buf_printf(b, "%-40s %.*f\n", name, prec, v);
    else pd_bench_buf_printf(b, "%-40s %s\n", name, "-");
}

static void rule(pd_bench_buf *b, const char *title, char fill) {
    int w = 50, n = (int)strlen(title), left = (w - n) / 2, right = w - n - left;
    for (int i = 0; i < left; i++) pd_bench_buf_append(b, &fill, 1);
    pd_bench_buf_puts(b, title);
    for (int i = 0; i < right; i++) pd_bench_buf_append(b, &fill, 1);
    pd_bench_buf_puts(b, "\n");
}

static void dist_rows(pd_bench_buf *b, const char *title, const char *name, const pd_bench_dist *d, bool p999) {
    char k[64];
    rule(b, title, '-');
    snprintf(k, sizeof k, "Mean %s (ms):", name), row(b, k, d->mean, 2);
    snprintf(k, sizeof k, "Median %s (ms):", name), row(b, k, d->median, 2);
    snprintf(k, sizeof k, "P90 %s (ms):", name), row(b, k, d->p90, 2);
    snprintf(k, sizeof k, "P99 %s (ms):", name), row(b, k, d->p99, 2);
    if (p999) snprintf(k, sizeof k, "P99.9 %s (ms):", name), row(b, k, d->p999, 2);
}

char *pd_bench_result_summary(const pd_bench_result *r, const pd_bench_slo *slo, const char *label) {
    const pd_bench_metrics *m = &r->metrics;
    pd_bench_buf b = {0};
    rule(&b, " Serving Benchmark Result ", '=');
    if (label) pd_bench_buf_printf(&b, "%-40s %s\n", "Label:", label);
    if (r->model) pd_bench_buf_printf(&b, "%-40s %s\n", "Model:", r->model);
    if (isfinite(r->request_rate)) row(&b, "Request rate (req/s):", r->request_rate, 2);
    else pd_bench_buf_printf(&b, "%-40s %s\n", "Request rate (req/s):", "inf");
    if (r->max_concurrency > 0) pd_bench_buf_printf(&b, "%-40s %d\n", "Max concurrency:", r->max_concurrency);
    pd_bench_buf_printf(&b, "%-40s %d\n", "Successful requests:", m->n_completed);
    pd_bench_buf_printf(&b, "%-40s %d\n", "Failed requests:", m->n_failed);
    row(&b, "Benchmark duration (s):", m->duration_s, 2);
    pd_bench_buf_printf(&b, "%-40s %lld\n", "Total input tokens:", (long long)m->n_input_tokens);
    pd_bench_buf_printf(&b, "%-40s %lld\n", "Total generated tokens:", (long long)m->n_output_tokens);
    row(&b, "Request throughput (req/s):", m->request_throughput, 2);
    row(&b, "Output token throughput (tok/s):", m->output_throughput, 2);
    row(&b, "Total token throughput (tok/s):", m->total_token_throughput, 2);
    if (pd_bench_slo_is_set(slo)) {
        char k[96] = "Goodput (req/s)", *p = k + strlen(k);
        if (slo->ttft_ms > 0) p += snprintf(p, (size_t)(k + sizeof k - p), " ttft<=%g", slo->ttft_ms);
        if (slo->tpot_ms > 0) p += snprintf(p, (size_t)(k + sizeof k - p), " tpot<=%g", slo->tpot_ms);
        if (slo->e2e_ms > 0) p += snprintf(p, (size_t)(k + sizeof k - p), " e2e<=%g", slo->e2e_ms);
        snprintf(p, (size_t)(k + sizeof k - p), ":");
        row(&b, k, m->goodput, 2);
        pd_bench_buf_printf(&b, "%-40s %d / %d\n", "Requests meeting the SLOs:", m->n_good, m->n_completed);
    }
    dist_rows(&b, "Time to First Token", "TTFT", &m->ttft_ms, false);
    dist_rows(&b, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot_ms, false);
    dist_rows(&b, "Inter-token Latency", "ITL", &m->itl_ms, true);
    dist_rows(&b, "End-to-end Latency", "E2E", &m->e2e_ms, false);
    int n_shown = 0;
    for (int i = 0; i < r->n_records && n_shown < 3; i++) {
        if (r->records[i].is_ok || !r->records[i].error) continue;
        if (n_shown++ == 0) rule(&b, "First errors", '-');
        pd_bench_buf_printf(&b, "request %d: %.300s\n", r->records[i].idx, r->records[i].error);
    }
    rule(&b, "", '=');
    return pd_bench_buf_take(&b);
}
