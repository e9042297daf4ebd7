// stats.c — the benchmark's statistics: percentiles, mean/std, TPOT, SLO checks, goodput and
// throughput. Pure functions over arrays and records: no I/O, no clock, no globals.
//
// Conventions (docs/bench.md states them for users):
//   * Percentiles interpolate linearly between closest ranks like numpy.percentile's default:
//     pos = q/100 * (n-1); lo = floor(pos); v = s[lo] + (s[lo+1] - s[lo]) * (pos - lo).
//   * Undefined values are NAN (TPOT of a one-token answer, TTFT of a failed request) and are
//     left out of every summary rather than counted as 0.
//   * Token and request throughputs count completed requests only; duration is the whole run
//     (first send to last completion), as vLLM does.
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"

double pd_bench_stats_percentile(const double *sorted, size_t n, double q) {
    if (n == 0) return NAN;
    if (q <= 0) return sorted[0];
    if (q >= 100) return sorted[n - 1];
    double pos = q / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    if (lo >= n - 1) return sorted[n - 1];
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

double pd_bench_stats_mean(const double *v, size_t n) {
    if (n == 0) return NAN;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    return s / (double)n;
}

double pd_bench_stats_std(const double *v, size_t n) {
    if (n == 0) return NAN;
    double m = pd_bench_stats_mean(v, n), s = 0;
    for (size_t i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
    return sqrt(s / (double)n);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

pd_status pd_bench_stats_dist(const double *v, size_t n, pd_bench_dist *out) {
    *out = (pd_bench_dist){0, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
    double *s = pd_malloc((n ? n : 1) * sizeof *s);
    if (!s) return PD_ERR_NOMEM;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!isnan(v[i])) s[m++] = v[i];
    if (m) {
        qsort(s, m, sizeof *s, cmp_double);
        out->n = m;
        out->mean = pd_bench_stats_mean(s, m);
        out->std = pd_bench_stats_std(s, m);
        out->min = s[0];
        out->max = s[m - 1];
        out->median = pd_bench_stats_percentile(s, m, 50);
        out->p90 = pd_bench_stats_percentile(s, m, 90);
        out->p99 = pd_bench_stats_percentile(s, m, 99);
        out->p999 = pd_bench_stats_percentile(s, m, 99.9);
    }
    pd_free(s);
    return PD_OK;
}

double pd_bench_stats_tpot(double ttft_ms, double e2e_ms, int n_output_tokens) {
    if (n_output_tokens < 2 || isnan(ttft_ms) || isnan(e2e_ms)) return NAN;
    return (e2e_ms - ttft_ms) / (double)(n_output_tokens - 1);
}

bool pd_bench_slo_is_set(const pd_bench_slo *slo) {
    return slo && (slo->ttft_ms > 0 || slo->tpot_ms > 0 || slo->e2e_ms > 0);
}

bool pd_bench_stats_meets_slo(const pd_bench_slo *slo, const pd_bench_record *r) {
    if (!r->is_ok) return false;
    if (!slo) return true;
    if (slo->ttft_ms > 0 && !(r->ttft_ms <= slo->ttft_ms)) return false;
    if (slo->tpot_ms > 0 && !isnan(r->tpot_ms) && !(r->tpot_ms <= slo->tpot_ms)) return false;
    if (slo->e2e_ms > 0 && !(r->e2e_ms <= slo->e2e_ms)) return false;
    return true;
}

pd_status pd_bench_slo_parse(const char *s, pd_bench_slo *out, pd_err *err) {
    *out = (pd_bench_slo){0};
    const char *p = s ? s : "";
    bool any = false;
    while (*p) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        const char *colon = strchr(p, ':');
        if (!colon) return pd_err_set(err, PD_ERR_INVALID, "goodput: '%s' is not NAME:MS", p);
        size_t name_len = (size_t)(colon - p);
        char *end;
        double v = strtod(colon + 1, &end);
        if (end == colon + 1 || !(v > 0) || !isfinite(v) || (*end && *end != ' ' && *end != ','))
            return pd_err_set(err, PD_ERR_INVALID, "goodput: bad value in '%s' (want a positive number of ms)", p);
        if (name_len == 4 && !strncmp(p, "ttft", 4)) out->ttft_ms = v;
        else if (name_len == 4 && !strncmp(p, "tpot", 4)) out->tpot_ms = v;
        else if (name_len == 3 && !strncmp(p, "e2e", 3)) out->e2e_ms = v;
        else if (name_len == 4 && !strncmp(p, "e2el", 4)) out->e2e_ms = v;  // vLLM's spelling
        else return pd_err_set(err, PD_ERR_INVALID, "goodput: unknown metric '%.*s' (ttft, tpot, e2e)", (int)name_len, p);
        any = true;
        p = end;
    }
    if (!any) return pd_err_set(err, PD_ERR_INVALID, "goodput: no SLO given (e.g. ttft:200 tpot:50)");
    return PD_OK;
}

// The per-request values of one metric over completed requests (NAN left in: dist skips them).
static pd_status gather(const pd_bench_record *recs, size_t n, size_t field_off, pd_bench_dist *out) {
    double *v = pd_malloc((n ? n : 1) * sizeof *v);
    if (!v) return PD_ERR_NOMEM;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (recs[i].is_ok) v[m++] = *(const double *)((const char *)&recs[i] + field_off);
    pd_status st = pd_bench_stats_dist(v, m, out);
    pd_free(v);
    return st;
}

pd_status pd_bench_stats_compute(const pd_bench_record *recs, size_t n, double duration_s,
                                 const pd_bench_slo *slo, pd_bench_metrics *out) {
    memset(out, 0, sizeof *out);
    out->duration_s = duration_s;
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++) {
        const pd_bench_record *r = &recs[i];
        if (!r->is_ok) {
            out->n_failed++;
            continue;
        }
        out->n_completed++;
        out->n_input_tokens += r->n_prompt_tokens;
        out->n_output_tokens += r->n_output_tokens;
        n_itl += (size_t)r->n_itl;
        if (pd_bench_stats_meets_slo(slo, r)) out->n_good++;
    }
    double d = duration_s > 0 ? duration_s : NAN;
    out->request_throughput = out->n_completed / d;
    out->output_throughput = (double)out->n_output_tokens / d;
    out->total_token_throughput = (double)(out->n_input_tokens + out->n_output_tokens) / d;
    out->goodput = pd_bench_slo_is_set(slo) ? out->n_good / d : NAN;
    if (!pd_bench_slo_is_set(slo)) out->n_good = 0;
    pd_status st;
    if ((st = gather(recs, n, offsetof(pd_bench_record, ttft_ms), &out->ttft_ms))) return st;
    if ((st = gather(recs, n, offsetof(pd_bench_record, tpot_ms), &out->tpot_ms))) return st;
    if ((st = gather(recs, n, offsetof(pd_bench_record, e2e_ms), &out->e2e_ms))) return st;
    double *itl = pd_malloc((n_itl ? n_itl : 1) * sizeof *itl);
    if (!itl) return PD_ERR_NOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (recs[i].is_ok)
            for (int j = 0; j < recs[i].n_itl; j++) itl[k++] = recs[i].itl_ms[j];
    st = pd_bench_stats_dist(itl, k, &out->itl_ms);
    pd_free(itl);
    return st;
}
