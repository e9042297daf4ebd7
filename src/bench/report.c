// report.c — the HTML report and standalone SVG charts, built from benchmark JSON documents
// (pd_bench_result_to_json's shape). One document is one configuration (its "label"); each of its
// "runs" is one request rate. A single run, a sweep and `bench merge` all come through here.
//
// Charts:
//   ttft_cdf, tpot_cdf, itl_cdf, e2e_cdf   empirical CDFs, one line per configuration × run
//                                          (ITL over every token gap, the others per request)
//   ttft_over_time                         every request's TTFT against its send time (scatter)
//   p99_ttft_vs_rate, p99_tpot_vs_rate,    only when some configuration has ≥ 2 runs at finite
//   throughput_vs_rate, goodput_vs_rate    rates; one line per configuration (goodput only when
//                                          an SLO was given)
// CDFs with more than CDF_MAX_POINTS values are drawn through that many evenly spaced quantiles,
// which keeps a 100k-token ITL curve to a few kilobytes without visible change.
//
// The HTML is one file: inline CSS, inline SVG, no script, no external reference (checked by
// tests/integration/test_bench.sh).
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench/bench.h"
#include "bench/bench_impl.h"
#include "http/http.h"

#define CDF_MAX_POINTS 400
#define MAX_SERIES 64
#define MAX_CHARTS 9

typedef struct series_set {
    pd_bench_svg_series s[MAX_SERIES];
    double *x[MAX_SERIES], *y[MAX_SERIES];  // owned
    char *name[MAX_SERIES];                 // owned
    int n;
} series_set;

typedef struct chart {
    const char *file;     // base name of the .svg
    const char *caption;  // static
    bool is_sweep;        // goes in the "Load sweep" section
    char *svg;            // owned
} chart;

static void set_fini(series_set *ss) {
    for (int i = 0; i < ss->n; i++) {
        pd_free(ss->x[i]);
        pd_free(ss->y[i]);
        pd_free(ss->name[i]);
    }
    ss->n = 0;
}

static double jnum(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

// Collects the values of `key` over the run's ok requests (concatenated when they are arrays).
static double *run_values(json_t *run, const char *key, size_t *n_out) {
    size_t n = 0, cap = 0, i;
    double *v = NULL;
    *n_out = 0;
    if (PD_ARRAY_RESERVE(v, cap, 256) != PD_OK) return NULL;
    json_t *r;
    json_array_foreach(json_object_get(run, "requests"), i, r) {
        if (!v) break;
        if (!json_is_true(json_object_get(r, "ok"))) continue;
        json_t *x = json_object_get(r, key);
        size_t m = json_is_array(x) ? json_array_size(x) : 1;
        if (PD_ARRAY_RESERVE(v, cap, n + m) != PD_OK) { pd_free(v); v = NULL; break; }
        for (size_t j = 0; j < m; j++) {
            json_t *e = json_is_array(x) ? json_array_get(x, j) : x;
            if (json_is_number(e) && isfinite(json_number_value(e))) v[n++] = json_number_value(e);
        }
    }
    *n_out = n;
    return v;
}

// The series' display name: "label", plus the rate / concurrency when the report shows several.
static char *series_name(json_t *doc, json_t *run, bool with_rate) {
    const char *label = json_string_value(json_object_get(doc, "label"));
    char buf[256], rate[64] = "";
    if (with_rate) {
        double r = jnum(run, "request_rate");
        int c = (int)json_integer_value(json_object_get(run, "max_concurrency"));
        if (isfinite(r)) snprintf(rate, sizeof rate, " @ %g req/s", r);
        else if (c > 0) snprintf(rate, sizeof rate, " @ %d concurrent", c);
        else snprintf(rate, sizeof rate, " @ inf req/s");
    }
    snprintf(buf, sizeof buf, "%s%s", label ? label : "pdserve", rate);
    return pd_strdup(buf);
}

// Adds the empirical CDF of `key` in `run` to ss. Colors: one per run when there is one
// configuration; else one per configuration, its runs from light (first rate) to solid (last).
// PD_OK or PD_ERR_NOMEM.
static pd_status add_cdf(series_set *ss, json_t *doc, json_t *run, const char *key, bool with_rate,
                         int doc_idx, int n_docs, int run_idx, int n_runs) {
    if (ss->n == MAX_SERIES) return PD_OK;
    size_t n;
    double *v = run_values(run, key, &n);
    if (!v) return PD_ERR_NOMEM;
    qsort(v, n, sizeof *v, cmp_double);
    size_t k = n <= CDF_MAX_POINTS ? n : CDF_MAX_POINTS;
    double *x = pd_malloc((k + 1) * sizeof *x), *y = pd_malloc((k + 1) * sizeof *y);
    char *name = series_name(doc, run, with_rate);
    if (!x || !y || !name) {
        pd_free(v), pd_free(x), pd_free(y), pd_free(name);
        return PD_ERR_NOMEM;
    }
    size_t m = 0;
    if (n > 0) x[m] = v[0], y[m++] = 0;  // the ECDF is 0 left of the smallest value
    for (size_t i = 0; i < k; i++) {
        if (n <= CDF_MAX_POINTS) {
            x[m] = v[i];
            y[m++] = 100.0 * (double)(i + 1) / (double)n;
        } else {
            double q = 100.0 * (double)(i + 1) / (double)k;
            x[m] = pd_bench_stats_percentile(v, n, q);
            y[m++] = q;
        }
    }
    pd_free(v);
    int i = ss->n++;
    ss->x[i] = x, ss->y[i] = y, ss->name[i] = name;
    ss->s[i] = (pd_bench_svg_series){.name = name, .x = x, .y = y, .n = (int)m};
    if (n_docs == 1) {
        ss->s[i].color = pd_bench_svg_color(run_idx);
    } else {
        ss->s[i].color = pd_bench_svg_color(doc_idx);
        ss->s[i].opacity = n_runs > 1 ? 0.3 + 0.7 * run_idx / (n_runs - 1) : 1.0;
    }
    return PD_OK;
}

// Adds TTFT against send time (seconds since the run started) of one run's ok requests.
static pd_status add_timeline(series_set *ss, json_t *doc, json_t *run, bool with_rate, int doc_idx, int n_docs,
                              int run_idx, int n_runs) {
    json_t *reqs = json_object_get(run, "requests");
    size_t n = json_array_size(reqs), i, m = 0;
    if (ss->n == MAX_SERIES) return PD_OK;
    double *x = pd_malloc((n ? n : 1) * sizeof *x), *y = pd_malloc((n ? n : 1) * sizeof *y);
    char *name = series_name(doc, run, with_rate);
    if (!x || !y || !name) {
        pd_free(x), pd_free(y), pd_free(name);
        return PD_ERR_NOMEM;
    }
    json_t *r;
    json_array_foreach(reqs, i, r) {
        double t = jnum(r, "start_s"), v = jnum(r, "ttft_ms");
        if (json_is_true(json_object_get(r, "ok")) && isfinite(t) && isfinite(v)) x[m] = t, y[m++] = v;
    }
    int k = ss->n++;
    ss->x[k] = x, ss->y[k] = y, ss->name[k] = name;
    ss->s[k] = (pd_bench_svg_series){.name = name, .x = x, .y = y, .n = (int)m, .is_scatter = true};
    ss->s[k].color = pd_bench_svg_color(n_docs == 1 ? run_idx : doc_idx);
    ss->s[k].opacity = n_docs == 1 || n_runs < 2 ? 0.8 : 0.3 + 0.6 * run_idx / (n_runs - 1);
    return PD_OK;
}

// Adds "metric vs rate" of one configuration (runs at finite rates only). path: "ttft_ms.p99" or
// "goodput". Skips configurations with fewer than 2 such points.
static pd_status add_rate_series(series_set *ss, json_t *doc, int doc_idx, const char *group, const char *field) {
    json_t *runs = json_object_get(doc, "runs");
    size_t n = json_array_size(runs), i, m = 0;
    if (ss->n == MAX_SERIES || n < 2) return PD_OK;
    double *x = pd_malloc(n * sizeof *x), *y = pd_malloc(n * sizeof *y);
    char *name = series_name(doc, NULL, false);
    if (!x || !y || !name) {
        pd_free(x), pd_free(y), pd_free(name);
        return PD_ERR_NOMEM;
    }
    json_t *run;
    json_array_foreach(runs, i, run) {
        double r = jnum(run, "request_rate");
        json_t *met = json_object_get(run, "metrics");
        double v = group ? jnum(json_object_get(met, group), field) : jnum(met, field);
        if (isfinite(r) && isfinite(v)) x[m] = r, y[m++] = v;
    }
    if (m < 2) {
        pd_free(x), pd_free(y), pd_free(name);
        return PD_OK;
    }
    int k = ss->n++;
    ss->x[k] = x, ss->y[k] = y, ss->name[k] = name;
    ss->s[k] = (pd_bench_svg_series){.name = name, .x = x, .y = y, .n = (int)m, .color = pd_bench_svg_color(doc_idx),
                                     .has_markers = true};
    return PD_OK;
}

// Whether x spans so many orders of magnitude that a linear axis would squash the fast lines
// against zero (e.g. TTFT of a cached vs an uncached configuration): max/min > 30, all x > 0.
static bool wants_log_x(const series_set *ss) {
    double lo = INFINITY, hi = 0;
    for (int i = 0; i < ss->n; i++)
        for (int k = 0; k < ss->s[i].n; k++) {
            double x = ss->s[i].x[k];
            if (!isfinite(x)) continue;
            if (x <= 0) return false;
            lo = fmin(lo, x), hi = fmax(hi, x);
        }
    return isfinite(lo) && hi / lo > 30;
}

// Renders ss (then emptied) into out. CDFs (is_step) switch to a log x axis when wants_log_x.
static pd_status render(chart *out, series_set *ss, const char *file, const char *caption, const char *title,
                        const char *x_label, const char *y_label, bool is_step) {
    pd_bench_svg_chart c = {.title = title, .x_label = x_label, .y_label = y_label, .series = ss->s,
                            .n_series = ss->n, .is_step = is_step, .is_log_x = is_step && wants_log_x(ss)};
    char log_label[96];
    if (c.is_log_x) {
        snprintf(log_label, sizeof log_label, "%s, log scale", x_label);
        c.x_label = log_label;
    }
    out->file = file;
    out->caption = caption;
    out->svg = pd_bench_svg_render(&c);
    set_fini(ss);
    return out->svg ? PD_OK : PD_ERR_NOMEM;
}

static bool any_sweep(json_t *const *docs, int n_docs) {
    for (int d = 0; d < n_docs; d++) {
        size_t i, n = 0;
        json_t *run;
        json_array_foreach(json_object_get(docs[d], "runs"), i, run) n += isfinite(jnum(run, "request_rate")) ? 1u : 0u;
        if (n >= 2) return true;
    }
    return false;
}

static bool any_goodput(json_t *const *docs, int n_docs) {
    for (int d = 0; d < n_docs; d++) {
        size_t i;
        json_t *run;
        json_array_foreach(json_object_get(docs[d], "runs"), i, run)
            if (isfinite(jnum(json_object_get(run, "metrics"), "goodput"))) return true;
    }
    return false;
}

// Builds every chart. *n_out charts in out (each svg owned). PD_OK or PD_ERR_NOMEM.
static pd_status build_charts(json_t *const *docs, int n_docs, chart *out, int *n_out) {
    static const struct { const char *key, *file, *title, *x_label, *y_label, *caption; } CDFS[] = {
        {"ttft_ms", "ttft_cdf", "Time to first token (CDF)", "TTFT (ms)", "% of requests",
         "Time from sending a request to its first content chunk."},
        {"tpot_ms", "tpot_cdf", "Time per output token (CDF)", "TPOT (ms)", "% of requests",
         "(E2E − TTFT) / (output tokens − 1) per request: the mean decode pace each user saw."},
        {"itl_ms", "itl_cdf", "Inter-token latency (CDF)", "ITL (ms)", "% of token gaps",
         "Every gap between consecutive chunks of every request: stalls show up as a long tail."},
        {"e2e_ms", "e2e_cdf", "End-to-end latency (CDF)", "E2E (ms)", "% of requests",
         "Time from sending a request to the end of its stream."},
    };
    bool with_rate = false;
    for (int d = 0; d < n_docs; d++) with_rate |= json_array_size(json_object_get(docs[d], "runs")) > 1;
    series_set ss = {0};
    pd_status st = PD_OK;
    *n_out = 0;
    for (size_t c = 0; c < PD_ARRAY_LEN(CDFS) && !st; c++) {
        for (int d = 0; d < n_docs && !st; d++) {
            size_t i;
            json_t *run;
            json_t *runs = json_object_get(docs[d], "runs");
            json_array_foreach(runs, i, run) {
                if ((st = add_cdf(&ss, docs[d], run, CDFS[c].key, with_rate, d, n_docs, (int)i,
                                  (int)json_array_size(runs))))
                    break;
            }
        }
        if (!st) st = render(&out[(*n_out)++], &ss, CDFS[c].file, CDFS[c].caption, CDFS[c].title, CDFS[c].x_label,
                             CDFS[c].y_label, true);
    }
    for (int d = 0; d < n_docs && !st; d++) {
        size_t i;
        json_t *run, *runs = json_object_get(docs[d], "runs");
        json_array_foreach(runs, i, run) {
            if ((st = add_timeline(&ss, docs[d], run, with_rate, d, n_docs, (int)i, (int)json_array_size(runs))))
                break;
        }
    }
    if (!st) st = render(&out[(*n_out)++], &ss, "ttft_over_time",
                         "TTFT of every request against the time it was sent: a rising cloud means requests queue "
                         "faster than the server drains them.", "TTFT over the run", "send time (s)", "TTFT (ms)",
                         false);
    if (st || !any_sweep(docs, n_docs)) goto done;
    static const struct { const char *group, *field, *file, *title, *y_label, *caption; } RATES[] = {
        {"ttft_ms", "p99", "p99_ttft_vs_rate", "P99 TTFT vs request rate", "P99 TTFT (ms)",
         "Where the TTFT tail turns up is where the server starts to queue."},
        {"tpot_ms", "p99", "p99_tpot_vs_rate", "P99 TPOT vs request rate", "P99 TPOT (ms)",
         "Decode pace of the slowest 1% of requests as the load grows."},
        {NULL, "output_throughput", "throughput_vs_rate", "Output throughput vs request rate", "output tokens/s",
         "Generated tokens per second; it flattens at the server's capacity."},
        {NULL, "goodput", "goodput_vs_rate", "Goodput vs request rate", "goodput (req/s)",
         "Requests per second that met every SLO given with --goodput."},
    };
    bool has_goodput = any_goodput(docs, n_docs);
    for (size_t c = 0; c < PD_ARRAY_LEN(RATES) && !st; c++) {
        if (!strcmp(RATES[c].field, "goodput") && !has_goodput) continue;
        for (int d = 0; d < n_docs && !st; d++) st = add_rate_series(&ss, docs[d], d, RATES[c].group, RATES[c].field);
        if (!st) st = render(&out[*n_out], &ss, RATES[c].file, RATES[c].caption, RATES[c].title,
                             "request rate (req/s)", RATES[c].y_label, false);
        out[(*n_out)++].is_sweep = true;
    }
done:
    set_fini(&ss);
    return st;
}

// ---- HTML ----------------------------------------------------------------------------------------

static const char CSS[] =
    "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1360px;"
    "padding:0 16px;color:#222;background:#fafafa}"
    "h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}"
    ".sub{color:#666;font-size:13px;margin-bottom:16px}"
    "table{border-collapse:collapse;font-size:12px;background:#fff;width:100%}"
    "th,td{border:1px solid #ddd;padding:3px 5px;text-align:right;white-space:nowrap}"
    "th{background:#f0f0f0;position:sticky;top:0;white-space:normal;vertical-align:bottom}td.l,th.l{text-align:left}"
    "td.msg{text-align:left;white-space:normal;word-break:break-word;max-width:520px;color:#444}"
    ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(640px,1fr));gap:16px}"
    "figure{margin:0;background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px}"
    "figcaption{font-size:12px;color:#555;padding:4px 8px}"
    ".wrap{overflow-x:auto}.bad{color:#c00}"
    "details{margin-top:8px;font-size:12px}pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto}";

static void cell(pd_bench_buf *b, double v, int prec) {
    if (isfinite(v)) pd_bench_buf_printf(b, "<td>%.*f</td>", prec, v);
    else pd_bench_buf_puts(b, "<td>–</td>");
}

static void summary_table(pd_bench_buf *b, json_t *const *docs, int n_docs) {
    // 19 columns that must fit a laptop screen (1366 px) without scrolling: headers wrap, the model
    // goes under the configuration's name.
    pd_bench_buf_puts(b, "<div class=\"wrap\"><table id=\"summary\"><tr><th class=\"l\">configuration / model</th>"
                         "<th>rate (req/s)</th><th>max conc.</th><th>ok / failed</th><th>duration (s)</th>"
                         "<th>req/s</th><th>out tok/s</th><th>total tok/s</th><th>goodput (req/s)</th>"
                         "<th>TTFT mean</th><th>TTFT p50</th><th>TTFT p99</th><th>TPOT mean</th><th>TPOT p50</th>"
                         "<th>TPOT p99</th><th>ITL p99</th><th>ITL p99.9</th><th>E2E p50</th><th>E2E p99</th></tr>\n");
    for (int d = 0; d < n_docs; d++) {
        size_t i;
        json_t *run;
        json_array_foreach(json_object_get(docs[d], "runs"), i, run) {
            json_t *m = json_object_get(run, "metrics");
            json_t *ttft = json_object_get(m, "ttft_ms"), *tpot = json_object_get(m, "tpot_ms");
            json_t *itl = json_object_get(m, "itl_ms"), *e2e = json_object_get(m, "e2e_ms");
            const char *label = json_string_value(json_object_get(docs[d], "label"));
            const char *model = json_string_value(json_object_get(run, "model"));
            int n_failed = (int)json_integer_value(json_object_get(m, "failed"));
            pd_bench_buf_printf(b, "<tr><td class=\"l\"><span style=\"color:%s\">&#9632;</span> ", pd_bench_svg_color(d));
            pd_bench_buf_escape(b, label ? label : "");
            pd_bench_buf_puts(b, "<br><span class=\"sub\">");
            pd_bench_buf_escape(b, model ? model : "");
            pd_bench_buf_puts(b, "</span></td>");
            double rate = jnum(run, "request_rate");
            if (isfinite(rate)) pd_bench_buf_printf(b, "<td>%g</td>", rate);
            else pd_bench_buf_puts(b, "<td>inf</td>");
            int conc = (int)json_integer_value(json_object_get(run, "max_concurrency"));
            if (conc > 0) pd_bench_buf_printf(b, "<td>%d</td>", conc);
            else pd_bench_buf_puts(b, "<td>–</td>");
            pd_bench_buf_printf(b, "<td%s>%d / %d</td>", n_failed ? " class=\"bad\"" : "",
                                (int)json_integer_value(json_object_get(m, "completed")), n_failed);
            cell(b, jnum(m, "duration_s"), 2);
            cell(b, jnum(m, "request_throughput"), 2);
            cell(b, jnum(m, "output_throughput"), 1);
            cell(b, jnum(m, "total_token_throughput"), 1);
            cell(b, jnum(m, "goodput"), 2);
            cell(b, jnum(ttft, "mean"), 2), cell(b, jnum(ttft, "median"), 2), cell(b, jnum(ttft, "p99"), 2);
            cell(b, jnum(tpot, "mean"), 2), cell(b, jnum(tpot, "median"), 2), cell(b, jnum(tpot, "p99"), 2);
            cell(b, jnum(itl, "p99"), 2), cell(b, jnum(itl, "p99_9"), 2);
            cell(b, jnum(e2e, "median"), 2), cell(b, jnum(e2e, "p99"), 2);
            pd_bench_buf_puts(b, "</tr>\n");
        }
    }
    pd_bench_buf_puts(b, "</table></div>\n<div class=\"sub\">Latencies in milliseconds. "
                         "TTFT: first content chunk; TPOT: (E2E − TTFT)/(output tokens − 1); ITL: every gap between "
                         "chunks; E2E: whole request. Goodput counts requests meeting every SLO.</div>\n");
}

static const char *status_reason(int status) { return status ? pd_http_status_reason(status) : "no response"; }

// ---- failures by reason ----------------------------------------------------------------------------
// A failed request's reason, from its error text (run.c writes "HTTP <status>: <body start>",
// "<status>: <transport message>", "error in stream: ...", "no content in the response"): the
// HTTP status with the OpenAI error code when the body has one, else the status alone; the
// transport status; "error in stream"; "no content". out: at least 96 bytes.
static void failure_reason(const json_t *r, char *out, size_t cap) {
    const char *e = json_string_value(json_object_get(r, "error"));
    int status = (int)json_integer_value(json_object_get(r, "http_status"));
    if (!e) e = "";
    if (!strncmp(e, "HTTP ", 5)) {
        const char *body = strchr(e, ':');
        json_t *o = body ? json_loads(body + 1, 0, NULL) : NULL;
        json_t *err = json_object_get(o, "error");
        const char *code = json_string_value(json_object_get(err, "code"));
        const char *type = json_string_value(json_object_get(err, "type"));
        if (code && *code) snprintf(out, cap, "HTTP %d %.60s", status, code);
        else if (type && *type) snprintf(out, cap, "HTTP %d %.60s", status, type);
        else snprintf(out, cap, "HTTP %d %s", status, status_reason(status));
        json_decref(o);
    } else if (!strncmp(e, "error in stream", 15)) {
        snprintf(out, cap, "error event in the stream");
    } else if (!strncmp(e, "no content", 10)) {
        snprintf(out, cap, "no content (empty answer)");
    } else {
        const char *colon = strchr(e, ':');
        int n = colon ? (int)(colon - e) : (int)strlen(e);
        snprintf(out, cap, "transport: %.*s", PD_MIN(n, 60), e);
    }
}

typedef struct fail_row {
    char reason[96];
    int n;
    char example[160];
} fail_row;

// One table: every (configuration, rate) with failures, its failures grouped by reason, most
// frequent first, with one example message each.
static void failures_table(pd_bench_buf *b, json_t *const *docs, int n_docs) {
    bool any = false;
    for (int d = 0; d < n_docs; d++) {
        size_t i;
        json_t *run;
        json_array_foreach(json_object_get(docs[d], "runs"), i, run) {
            fail_row rows[32];
            int n_rows = 0, n_other = 0;
            size_t k;
            json_t *r;
            json_array_foreach(json_object_get(run, "requests"), k, r) {
                if (json_is_true(json_object_get(r, "ok"))) continue;
                char reason[96];
                failure_reason(r, reason, sizeof reason);
                int j = 0;
                while (j < n_rows && strcmp(rows[j].reason, reason)) j++;
                if (j == n_rows) {
                    if (n_rows == (int)PD_ARRAY_LEN(rows)) {
                        n_other++;
                        continue;
                    }
                    memset(&rows[j], 0, sizeof rows[j]);
                    snprintf(rows[j].reason, sizeof rows[j].reason, "%s", reason);
                    const char *e = json_string_value(json_object_get(r, "error"));
                    snprintf(rows[j].example, sizeof rows[j].example, "%s", e ? e : "");
                    n_rows++;
                }
                rows[j].n++;
            }
            if (!n_rows) continue;
            if (!any) {
                pd_bench_buf_puts(b, "<h2>Failures by reason</h2>\n<div class=\"wrap\"><table id=\"failures\"><tr>"
                                     "<th class=\"l\">configuration</th><th>rate (req/s)</th><th class=\"l\">reason</th>"
                                     "<th>requests</th><th class=\"l\">example</th></tr>\n");
                any = true;
            }
            for (int a = 0; a < n_rows; a++)  // most frequent first (few rows: insertion sort)
                for (int c = a; c > 0 && rows[c].n > rows[c - 1].n; c--) {
                    fail_row t = rows[c];
                    rows[c] = rows[c - 1];
                    rows[c - 1] = t;
                }
            const char *label = json_string_value(json_object_get(docs[d], "label"));
            double rate = jnum(run, "request_rate");
            for (int a = 0; a < n_rows; a++) {
                pd_bench_buf_puts(b, "<tr><td class=\"l\">");
                pd_bench_buf_escape(b, label ? label : "");
                if (isfinite(rate)) pd_bench_buf_printf(b, "</td><td>%g</td><td class=\"l bad\">", rate);
                else pd_bench_buf_puts(b, "</td><td>inf</td><td class=\"l bad\">");
                pd_bench_buf_escape(b, rows[a].reason);
                pd_bench_buf_printf(b, "</td><td>%d</td><td class=\"msg\">", rows[a].n);
                pd_bench_buf_escape(b, rows[a].example);
                pd_bench_buf_puts(b, "</td></tr>\n");
            }
            if (n_other) pd_bench_buf_printf(b, "<tr><td class=\"l\" colspan=\"3\">other reasons</td><td>%d</td><td></td></tr>\n", n_other);
        }
    }
    if (any)
        pd_bench_buf_puts(b, "</table></div>\n<div class=\"sub\">A reason is the HTTP status with the server's error code, "
                             "a transport error, or an error event inside a stream.</div>\n");
}

static void config_details(pd_bench_buf *b, json_t *const *docs, int n_docs) {
    for (int d = 0; d < n_docs; d++) {
        const char *label = json_string_value(json_object_get(docs[d], "label"));
        char *cfg = json_dumps(json_object_get(docs[d], "config"), JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        pd_bench_buf_puts(b, "<details><summary>configuration: ");
        pd_bench_buf_escape(b, label ? label : "");
        pd_bench_buf_puts(b, "</summary><pre>");
        pd_bench_buf_escape(b, cfg ? cfg : "");
        pd_bench_buf_puts(b, "</pre></details>\n");
        free(cfg);
    }
}

static char *build_html(json_t *const *docs, int n_docs, const chart *charts, int n_charts) {
    pd_bench_buf b = {0};
    pd_bench_buf_printf(&b, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                            "<title>pdserve bench report</title><style>%s</style></head><body>\n", CSS);
    pd_bench_buf_puts(&b, "<h1>pdserve bench report</h1><div class=\"sub\">");
    for (int d = 0; d < n_docs; d++) {
        json_t *cfg = json_object_get(docs[d], "config");
        const char *label = json_string_value(json_object_get(docs[d], "label"));
        const char *ds = json_string_value(json_object_get(json_object_get(cfg, "dataset"), "name"));
        const char *url = json_string_value(json_object_get(cfg, "url"));
        const char *ep = json_string_value(json_object_get(cfg, "endpoint"));
        pd_bench_buf_printf(&b, "%s<b style=\"color:%s\">", d ? "<br>" : "", pd_bench_svg_color(d));
        pd_bench_buf_escape(&b, label ? label : "");
        pd_bench_buf_puts(&b, "</b>: ");
        pd_bench_buf_escape(&b, url ? url : "");
        pd_bench_buf_escape(&b, ep ? ep : "");
        pd_bench_buf_puts(&b, ", dataset ");
        pd_bench_buf_escape(&b, ds ? ds : "?");
        pd_bench_buf_printf(&b, ", %d prompts, %zu run(s)",
                            (int)json_integer_value(json_object_get(json_object_get(cfg, "dataset"), "num_prompts")),
                            json_array_size(json_object_get(docs[d], "runs")));
    }
    pd_bench_buf_puts(&b, "</div>\n<h2>Summary</h2>\n");
    summary_table(&b, docs, n_docs);
    failures_table(&b, docs, n_docs);
    for (int c = 0; c < n_charts; c++) {
        if (c == 0) pd_bench_buf_puts(&b, "<h2>Latency distributions</h2>\n<div class=\"grid\">\n");
        if (c > 0 && charts[c].is_sweep && !charts[c - 1].is_sweep)
            pd_bench_buf_puts(&b, "</div>\n<h2>Load sweep</h2>\n<div class=\"grid\">\n");
        pd_bench_buf_printf(&b, "<figure id=\"%s\">\n%s<figcaption>", charts[c].file, charts[c].svg);
        pd_bench_buf_escape(&b, charts[c].caption);
        pd_bench_buf_puts(&b, "</figcaption></figure>\n");
    }
    if (n_charts) pd_bench_buf_puts(&b, "</div>\n");
    pd_bench_buf_puts(&b, "<h2>Configurations</h2>\n");
    config_details(&b, docs, n_docs);
    pd_bench_buf_puts(&b, "</body></html>\n");
    return pd_bench_buf_take(&b);
}

// ---- files -----------------------------------------------------------------------------------------

pd_status pd_bench_report_write_file(const char *path, const char *text, pd_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return pd_err_set(err, PD_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n;
    ok &= fclose(f) == 0;
    return ok ? PD_OK : pd_err_set(err, PD_ERR_IO, "cannot write %s: %s", path, strerror(errno));
}

// mkdir -p
static pd_status make_dirs(const char *dir, pd_err *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; ; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(path, 0777) != 0 && errno != EEXIST)
                return pd_err_set(err, PD_ERR_IO, "cannot create %s: %s", path, strerror(errno));
            *p = c;
            if (!c) break;
        }
    }
    return PD_OK;
}

pd_status pd_bench_report_build(json_t *const *docs, int n_docs, char **html_out, const char *svg_dir,
                                pd_err *err) {
    if (html_out) *html_out = NULL;
    for (int d = 0; d < n_docs; d++) {
        pd_status st = pd_bench_result_check_json(docs[d], err);
        if (st) return st;
    }
    chart charts[MAX_CHARTS] = {0};
    int n_charts = 0;
    pd_status st = build_charts(docs, n_docs, charts, &n_charts);
    if (st) {
        pd_err_set(err, st, "report: out of memory");
        goto done;
    }
    if (svg_dir) {
        if ((st = make_dirs(svg_dir, err))) goto done;
        for (int c = 0; c < n_charts && !st; c++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s.svg", svg_dir, charts[c].file);
            st = pd_bench_report_write_file(path, charts[c].svg, err);
        }
        if (st) goto done;
    }
    if (html_out && !(*html_out = build_html(docs, n_docs, charts, n_charts)))
        st = pd_err_set(err, PD_ERR_NOMEM, "report: out of memory");
done:
    for (int c = 0; c < n_charts; c++) pd_free(charts[c].svg);
    return st;
}
