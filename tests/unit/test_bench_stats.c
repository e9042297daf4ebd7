// test_bench_stats.c — the pure parts of `pdserve bench`: percentiles against values computed by
// hand (and matching numpy.percentile's default), mean/std, TPOT, SLO parsing and goodput,
// aggregate metrics over hand-made records, gamma arrivals, datasets (lengths, id ranges, shared
// prefixes, traces), the JSON document and the SVG/HTML report built from it.
#include "test.h"

#include <math.h>
#include <unistd.h>

#include "bench/bench.h"

// ---- percentiles and moments --------------------------------------------------------------------

PD_TEST(percentile_linear_like_numpy) {
    const double a[] = {1, 2, 3, 4};
    // np.percentile([1,2,3,4], q): pos = q/100*3
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 50), 2.5, 1e-12);
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 90), 3.7, 1e-12);
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 99), 3.97, 1e-12);
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 0), 1, 0);
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 100), 4, 0);
    PD_CHECK_NEAR(pd_bench_stats_percentile(a, 4, 25), 1.75, 1e-12);
    const double b[] = {15, 20, 35, 40, 50};
    PD_CHECK_NEAR(pd_bench_stats_percentile(b, 5, 40), 29, 1e-12);      // pos 1.6: 20 + 0.6*15
    PD_CHECK_NEAR(pd_bench_stats_percentile(b, 5, 99.9), 49.96, 1e-9);  // pos 3.996: 40 + 0.996*10
    PD_CHECK_NEAR(pd_bench_stats_percentile(b, 5, 50), 35, 0);          // exact rank
    const double one[] = {7};
    PD_CHECK_NEAR(pd_bench_stats_percentile(one, 1, 50), 7, 0);
    PD_CHECK_NEAR(pd_bench_stats_percentile(one, 1, 99.9), 7, 0);
    PD_CHECK(isnan(pd_bench_stats_percentile(NULL, 0, 50)));
}

PD_TEST(mean_std_dist) {
    const double v[] = {2, 4, 4, 4, 5, 5, 7, 9};
    PD_CHECK_NEAR(pd_bench_stats_mean(v, 8), 5, 1e-12);
    PD_CHECK_NEAR(pd_bench_stats_std(v, 8), 2, 1e-12);  // population std
    PD_CHECK(isnan(pd_bench_stats_mean(NULL, 0)));
    // Unsorted, with NANs that must be skipped; the input must not be reordered.
    double u[] = {50, NAN, 15, 40, 20, NAN, 35};
    pd_bench_dist d;
    PD_REQUIRE(pd_bench_stats_dist(u, 7, &d) == PD_OK);
    PD_CHECK_EQ(d.n, 5);
    PD_CHECK_NEAR(d.mean, 32, 1e-12);
    PD_CHECK_NEAR(d.min, 15, 0);
    PD_CHECK_NEAR(d.max, 50, 0);
    PD_CHECK_NEAR(d.median, 35, 0);
    PD_CHECK_NEAR(d.p90, 46, 1e-12);    // pos 3.6: 40 + 0.6*10
    PD_CHECK_NEAR(d.p99, 49.6, 1e-12);  // pos 3.96
    PD_CHECK_NEAR(d.p999, 49.96, 1e-9);
    PD_CHECK_NEAR(d.std, sqrt((18 * 18 + 17 * 17 + 8 * 8 + 12 * 12 + 3 * 3) / 5.0), 1e-12);
    PD_CHECK_NEAR(u[0], 50, 0);
    PD_CHECK_NEAR(u[2], 15, 0);
    PD_REQUIRE(pd_bench_stats_dist(u, 0, &d) == PD_OK);
    PD_CHECK_EQ(d.n, 0);
    PD_CHECK(isnan(d.mean) && isnan(d.p99) && isnan(d.p999));
}

PD_TEST(tpot_definition) {
    PD_CHECK_NEAR(pd_bench_stats_tpot(100, 400, 4), 100, 1e-12);  // (400-100)/(4-1)
    PD_CHECK_NEAR(pd_bench_stats_tpot(50, 50, 2), 0, 0);
    PD_CHECK(isnan(pd_bench_stats_tpot(100, 400, 1)));
    PD_CHECK(isnan(pd_bench_stats_tpot(NAN, 400, 5)));
}

// ---- SLOs and goodput ----------------------------------------------------------------------------

PD_TEST(slo_parse) {
    pd_bench_slo s;
    pd_err err = {0};
    PD_CHECK_EQ(pd_bench_slo_parse("ttft:200 tpot:50", &s, &err), PD_OK);
    PD_CHECK_NEAR(s.ttft_ms, 200, 0);
    PD_CHECK_NEAR(s.tpot_ms, 50, 0);
    PD_CHECK_NEAR(s.e2e_ms, 0, 0);
    PD_CHECK_EQ(pd_bench_slo_parse("e2e:3000,ttft:12.5", &s, &err), PD_OK);
    PD_CHECK_NEAR(s.e2e_ms, 3000, 0);
    PD_CHECK_NEAR(s.ttft_ms, 12.5, 0);
    PD_CHECK_NEAR(s.tpot_ms, 0, 0);
    PD_CHECK_EQ(pd_bench_slo_parse("e2el:10", &s, &err), PD_OK);
    PD_CHECK_NEAR(s.e2e_ms, 10, 0);
    PD_CHECK_EQ(pd_bench_slo_parse("foo:1", &s, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "foo");
    PD_CHECK_EQ(pd_bench_slo_parse("ttft:-1", &s, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_bench_slo_parse("ttft:abc", &s, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_bench_slo_parse("ttft", &s, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_bench_slo_parse("ttft:5ms", &s, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_bench_slo_parse("", &s, &err), PD_ERR_INVALID);
    PD_CHECK(!pd_bench_slo_is_set(&s));
}

static pd_bench_record rec(bool ok, double ttft, double e2e, int n_in, int n_out) {
    pd_bench_record r = {.is_ok = ok, .ttft_ms = ttft, .e2e_ms = e2e, .n_prompt_tokens = n_in,
                         .n_output_tokens = n_out};
    r.tpot_ms = pd_bench_stats_tpot(ttft, e2e, n_out);
    return r;
}

PD_TEST(meets_slo) {
    pd_bench_slo slo = {.ttft_ms = 100, .tpot_ms = 20};
    pd_bench_record a = rec(true, 100, 280, 10, 10);  // tpot 20: both limits are inclusive
    pd_bench_record b = rec(true, 101, 200, 10, 10);  // ttft over
    pd_bench_record c = rec(true, 50, 300, 10, 11);   // tpot 25 over
    pd_bench_record d = rec(true, 50, 50, 10, 1);     // one token: no TPOT, meets
    pd_bench_record e = rec(false, 10, 20, 10, 10);   // failed never counts
    PD_CHECK(pd_bench_stats_meets_slo(&slo, &a));
    PD_CHECK(!pd_bench_stats_meets_slo(&slo, &b));
    PD_CHECK(!pd_bench_stats_meets_slo(&slo, &c));
    PD_CHECK(pd_bench_stats_meets_slo(&slo, &d));
    PD_CHECK(!pd_bench_stats_meets_slo(&slo, &e));
    pd_bench_slo e2e = {.e2e_ms = 250};
    PD_CHECK(!pd_bench_stats_meets_slo(&e2e, &a));
    PD_CHECK(pd_bench_stats_meets_slo(&e2e, &b));
}

PD_TEST(compute_aggregates) {
    double itl0[] = {10, 30}, itl1[] = {20}, itl3[] = {999};
    pd_bench_record r[4] = {
        rec(true, 100, 140, 5, 3),   // tpot 20
        rec(true, 200, 220, 7, 2),   // tpot 20
        rec(false, NAN, 50, 9, 0),   // failed: excluded everywhere
        rec(true, 300, 300, 11, 1),  // one token: tpot NAN
    };
    r[0].itl_ms = itl0, r[0].n_itl = 2;
    r[1].itl_ms = itl1, r[1].n_itl = 1;
    r[2].itl_ms = itl3, r[2].n_itl = 1;
    pd_bench_slo slo = {.ttft_ms = 250};
    pd_bench_metrics m;
    PD_REQUIRE(pd_bench_stats_compute(r, 4, 2.0, &slo, &m) == PD_OK);
    PD_CHECK_EQ(m.n_completed, 3);
    PD_CHECK_EQ(m.n_failed, 1);
    PD_CHECK_EQ(m.n_input_tokens, 23);
    PD_CHECK_EQ(m.n_output_tokens, 6);
    PD_CHECK_NEAR(m.request_throughput, 1.5, 1e-12);
    PD_CHECK_NEAR(m.output_throughput, 3, 1e-12);
    PD_CHECK_NEAR(m.total_token_throughput, 14.5, 1e-12);
    PD_CHECK_EQ(m.n_good, 2);  // ttft 100 and 200 meet 250; 300 does not
    PD_CHECK_NEAR(m.goodput, 1.0, 1e-12);
    PD_CHECK_EQ(m.ttft_ms.n, 3);
    PD_CHECK_NEAR(m.ttft_ms.mean, 200, 1e-12);
    PD_CHECK_NEAR(m.ttft_ms.p90, 280, 1e-12);
    PD_CHECK_EQ(m.tpot_ms.n, 2);
    PD_CHECK_NEAR(m.tpot_ms.mean, 20, 1e-12);
    PD_CHECK_EQ(m.itl_ms.n, 3);  // 10, 30, 20: the failed request's 999 is not in
    PD_CHECK_NEAR(m.itl_ms.max, 30, 0);
    PD_CHECK_NEAR(m.itl_ms.median, 20, 0);
    PD_CHECK_NEAR(m.e2e_ms.median, 220, 0);
    // Without SLOs goodput is undefined, not zero.
    PD_REQUIRE(pd_bench_stats_compute(r, 4, 2.0, NULL, &m) == PD_OK);
    PD_CHECK(isnan(m.goodput));
    // Nothing completed: no division by zero, NAN summaries.
    PD_REQUIRE(pd_bench_stats_compute(&r[2], 1, 0.0, &slo, &m) == PD_OK);
    PD_CHECK_EQ(m.n_completed, 0);
    PD_CHECK(isnan(m.ttft_ms.mean));
    PD_CHECK(!(m.request_throughput > 0));
}

// ---- arrivals ------------------------------------------------------------------------------------

PD_TEST(gamma_mean_and_arrivals) {
    pd_rng rng;
    pd_rng_seed(&rng, 42);
    const double shapes[] = {0.5, 1.0, 4.0};
    for (size_t k = 0; k < PD_ARRAY_LEN(shapes); k++) {
        double s = 0, s2 = 0;
        int n = 40000;
        for (int i = 0; i < n; i++) {
            double g = pd_bench_dataset_gamma(&rng, shapes[k], 2.0);
            PD_CHECK(g >= 0);
            s += g, s2 += g * g;
        }
        double mean = s / n, var = s2 / n - mean * mean;
        PD_CHECK_NEAR(mean, shapes[k] * 2.0, 0.05 * shapes[k] * 2.0);  // mean = k*theta
        PD_CHECK_NEAR(var, shapes[k] * 4.0, 0.1 * shapes[k] * 4.0);    // var = k*theta^2
    }
    double a[2001], b[2001];
    pd_bench_dataset_arrivals(2001, 10.0, 1.0, 7, a);
    pd_bench_dataset_arrivals(2001, 10.0, 1.0, 7, b);
    PD_CHECK_NEAR(a[0], 0, 0);
    bool mono = true, same = true;
    for (int i = 1; i < 2001; i++) mono &= a[i] >= a[i - 1], same &= a[i] == b[i];
    PD_CHECK(mono);
    PD_CHECK(same);
    PD_CHECK_NEAR(a[2000], 200.0, 20.0);  // 2000 gaps of mean 0.1 s
    pd_bench_dataset_arrivals(5, INFINITY, 1.0, 7, a);
    for (int i = 0; i < 5; i++) PD_CHECK_NEAR(a[i], 0, 0);
    // Burstiness keeps the mean rate.
    pd_bench_dataset_arrivals(2001, 10.0, 0.25, 7, a);
    PD_CHECK_NEAR(a[2000], 200.0, 40.0);
}

// ---- datasets ------------------------------------------------------------------------------------

PD_TEST(dataset_random_lengths_and_ids) {
    pd_bench_dataset_params p = pd_bench_dataset_params_default();
    p.n_prompts = 50, p.input_len = 32, p.output_len = 16, p.seed = 3;
    pd_err err = {0};
    pd_bench_dataset *d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    PD_CHECK_EQ(d->n, 50);
    PD_CHECK(!d->has_arrivals);
    bool ok = true;
    for (int i = 0; i < d->n; i++) {
        ok &= d->prompts[i].n_ids == 32 && d->prompts[i].n_output == 16 && !d->prompts[i].text;
        for (int j = 0; j < d->prompts[i].n_ids; j++) ok &= d->prompts[i].ids[j] >= 100 && d->prompts[i].ids[j] < 4000;
    }
    PD_CHECK(ok);
    pd_bench_dataset *d2 = pd_bench_dataset_new(&p, &err);  // same seed, same prompts
    PD_REQUIRE(d2 != NULL);
    PD_CHECK(!memcmp(d->prompts[7].ids, d2->prompts[7].ids, 32 * sizeof(int32_t)));
    PD_CHECK(memcmp(d->prompts[7].ids, d->prompts[8].ids, 32 * sizeof(int32_t)) != 0);
    pd_bench_dataset_free(d2);
    pd_bench_dataset_free(d);

    p.range_ratio = 0.5, p.token_id_min = 10, p.token_id_max = 12;
    d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    int lo = 1 << 30, hi = 0;
    ok = true;
    for (int i = 0; i < d->n; i++) {
        lo = PD_MIN(lo, d->prompts[i].n_ids), hi = PD_MAX(hi, d->prompts[i].n_ids);
        ok &= d->prompts[i].n_output >= 8 && d->prompts[i].n_output <= 24;
        for (int j = 0; j < d->prompts[i].n_ids; j++) ok &= d->prompts[i].ids[j] == 10 || d->prompts[i].ids[j] == 11;
    }
    PD_CHECK(ok);
    PD_CHECK(lo >= 16 && hi <= 48 && lo < hi);
    pd_bench_dataset_free(d);

    p.token_id_max = 10;  // empty range
    PD_CHECK(pd_bench_dataset_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
}

PD_TEST(dataset_shared_prefix_and_long_mix) {
    pd_bench_dataset_params p = pd_bench_dataset_params_default();
    p.kind = PD_BENCH_DATASET_SHARED_PREFIX;
    p.n_prompts = 40, p.prefix_len = 20, p.n_prefixes = 2, p.suffix_len = 5, p.output_len = 4;
    pd_err err = {0};
    pd_bench_dataset *d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    int n_same_as_first = 0;
    for (int i = 0; i < d->n; i++) {
        PD_CHECK_EQ(d->prompts[i].n_ids, 25);
        n_same_as_first += !memcmp(d->prompts[i].ids, d->prompts[0].ids, 20 * sizeof(int32_t));
    }
    PD_CHECK(n_same_as_first > 5 && n_same_as_first < 40);  // two prefixes, both used
    pd_bench_dataset_free(d);

    p = pd_bench_dataset_params_default();
    p.kind = PD_BENCH_DATASET_LONG_MIX;
    p.n_prompts = 400, p.long_fraction = 0.25, p.long_len = 64, p.short_len = 8, p.output_len = 2;
    d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    int n_long = 0;
    for (int i = 0; i < d->n; i++) {
        PD_CHECK(d->prompts[i].n_ids == 64 || d->prompts[i].n_ids == 8);
        n_long += d->prompts[i].n_ids == 64;
    }
    PD_CHECK(n_long > 70 && n_long < 130);
    pd_bench_dataset_free(d);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

PD_TEST(dataset_trace) {
    char path[] = "/tmp/pd_bench_trace_XXXXXX";
    int fd = mkstemp(path);
    PD_REQUIRE(fd >= 0);
    close(fd);
    write_text(path, "{\"timestamp\": 10.5, \"prompt_len\": 4, \"output_len\": 3}\n"
                     "\n# a comment\n"
                     "{\"timestamp\": 10.0, \"prompt\": \"hello there\", \"max_tokens\": 2}\n"
                     "{\"timestamp\": 12, \"input_length\": 6, \"output_length\": 1}\n");
    pd_bench_dataset_params p = pd_bench_dataset_params_default();
    p.kind = PD_BENCH_DATASET_TRACE, p.trace_path = path, p.n_prompts = 0;
    pd_err err = {0};
    pd_bench_dataset *d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    PD_CHECK(d->has_arrivals);
    PD_REQUIRE(d->n == 3);
    PD_CHECK_STR(d->prompts[0].text, "hello there");  // sorted by timestamp
    PD_CHECK_NEAR(d->prompts[0].arrival_s, 0, 0);
    PD_CHECK_EQ(d->prompts[0].n_output, 2);
    PD_CHECK_EQ(d->prompts[1].n_ids, 4);
    PD_CHECK_NEAR(d->prompts[1].arrival_s, 0.5, 1e-12);
    PD_CHECK_EQ(d->prompts[2].n_ids, 6);
    PD_CHECK_NEAR(d->prompts[2].arrival_s, 2.0, 1e-12);
    pd_bench_dataset_free(d);
    p.n_prompts = 1;  // first line only
    d = pd_bench_dataset_new(&p, &err);
    PD_REQUIRE(d != NULL);
    PD_CHECK_EQ(d->n, 1);
    pd_bench_dataset_free(d);

    write_text(path, "{\"timestamp\": 1, \"prompt_len\": 4, \"output_len\": 3}\n{\"timestamp\": 2, \"output_len\": 3}\n");
    p.n_prompts = 0;
    PD_CHECK(pd_bench_dataset_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "line 2");
    write_text(path, "not json\n");
    PD_CHECK(pd_bench_dataset_new(&p, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "line 1");
    unlink(path);
    PD_CHECK(pd_bench_dataset_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_NOTFOUND);
}

PD_TEST(ids_to_text_is_deterministic) {
    int32_t ids[] = {0, 1, 2, 64};
    char *s = pd_bench_dataset_ids_to_text(ids, 4);
    PD_CHECK_STR(s, "the of and the");
    pd_free(s);
    s = pd_bench_dataset_ids_to_text(ids, 0);
    PD_CHECK_STR(s, "");
    pd_free(s);
}

// ---- JSON document and report --------------------------------------------------------------------

// A result with two requests built by hand (what run.c would fill in).
static pd_bench_result *fake_result(double rate, double ttft0) {
    pd_bench_result *r = pd_calloc(1, sizeof *r);
    r->request_rate = rate;
    r->burstiness = 1;
    r->model = pd_strdup("m<&>");
    r->n_records = 2;
    r->records = pd_calloc(2, sizeof *r->records);
    r->records[0] = rec(true, ttft0, ttft0 + 30, 8, 4);
    r->records[0].itl_ms = pd_malloc(3 * sizeof(double));
    for (int i = 0; i < 3; i++) r->records[0].itl_ms[i] = 10 + i;
    r->records[0].n_itl = 3;
    r->records[1] = rec(false, NAN, 5, 8, 0);
    r->records[1].idx = 1;
    r->records[1].error = pd_strdup("HTTP 503: busy");
    pd_bench_slo slo = {.ttft_ms = 1000};
    pd_bench_stats_compute(r->records, 2, 1.0, &slo, &r->metrics);
    return r;
}

PD_TEST(result_json_and_summary) {
    pd_bench_params p = pd_bench_params_default();
    p.base_url = "http://127.0.0.1:1";
    pd_bench_dataset_params dp = pd_bench_dataset_params_default();
    pd_bench_config cfg = {.label = "cfg A", .params = &p, .dataset = &dp};
    pd_bench_result *runs[2] = {fake_result(2, 100), fake_result(INFINITY, 200)};
    json_t *doc = pd_bench_result_to_json(&cfg, runs, 2);
    PD_REQUIRE(doc != NULL);
    pd_err err = {0};
    PD_CHECK_EQ(pd_bench_result_check_json(doc, &err), PD_OK);
    json_t *run0 = json_array_get(json_object_get(doc, "runs"), 0);
    json_t *m = json_object_get(run0, "metrics");
    PD_CHECK_EQ(json_integer_value(json_object_get(m, "completed")), 1);
    PD_CHECK_EQ(json_integer_value(json_object_get(m, "failed")), 1);
    PD_CHECK_NEAR(json_real_value(json_object_get(json_object_get(m, "ttft_ms"), "p99")), 100, 1e-9);
    PD_CHECK_NEAR(json_number_value(json_object_get(m, "goodput")), 1, 1e-12);
    PD_CHECK(json_is_null(json_object_get(json_array_get(json_object_get(doc, "runs"), 1), "request_rate")));
    json_t *req1 = json_array_get(json_object_get(run0, "requests"), 1);
    PD_CHECK_STR(json_string_value(json_object_get(req1, "error")), "HTTP 503: busy");
    PD_CHECK(json_is_null(json_object_get(req1, "ttft_ms")));
    PD_CHECK_EQ(json_array_size(json_object_get(json_array_get(json_object_get(run0, "requests"), 0), "itl_ms")), 3);

    char *s = pd_bench_result_summary(runs[0], &p.slo, "cfg A");
    PD_REQUIRE(s != NULL);
    PD_CHECK_CONTAINS(s, "Successful requests:                     1");
    PD_CHECK_CONTAINS(s, "Failed requests:                         1");
    PD_CHECK_CONTAINS(s, "P99.9 ITL (ms):");
    PD_CHECK_CONTAINS(s, "request 1: HTTP 503: busy");
    pd_free(s);

    // The report: self-contained HTML, four CDFs and a timeline; no sweep charts (one finite rate).
    char *html = NULL;
    PD_REQUIRE(pd_bench_report_build(&doc, 1, &html, NULL, &err) == PD_OK);
    PD_CHECK_CONTAINS(html, "<!DOCTYPE html>");
    PD_CHECK_CONTAINS(html, "id=\"ttft_cdf\"");
    PD_CHECK_CONTAINS(html, "id=\"itl_cdf\"");
    PD_CHECK_CONTAINS(html, "m&lt;&amp;&gt;");  // escaped model name
    PD_CHECK(!strstr(html, "p99_ttft_vs_rate"));
    PD_CHECK(!strstr(html, "src=\"http") && !strstr(html, "href=\"http"));
    int n_svg = 0;
    for (const char *q = html; (q = strstr(q, "<svg")); q++) n_svg++;
    PD_CHECK_EQ(n_svg, 5);  // four CDFs and the TTFT timeline
    PD_CHECK_CONTAINS(html, "id=\"ttft_over_time\"");
    pd_free(html);

    // merge --goodput: recomputed from the records (request 0 has TTFT 100 in run 0, 200 in run 1).
    pd_bench_slo tight = {.ttft_ms = 150};
    PD_REQUIRE(pd_bench_result_apply_slo(doc, &tight, &err) == PD_OK);
    json_t *runs_j = json_object_get(doc, "runs");
    json_t *m0 = json_object_get(json_array_get(runs_j, 0), "metrics");
    json_t *m1 = json_object_get(json_array_get(runs_j, 1), "metrics");
    PD_CHECK_EQ(json_integer_value(json_object_get(m0, "good_requests")), 1);
    PD_CHECK_EQ(json_integer_value(json_object_get(m1, "good_requests")), 0);
    PD_CHECK_NEAR(json_number_value(json_object_get(m1, "goodput")), 0, 0);
    PD_CHECK_NEAR(json_number_value(json_object_get(json_object_get(json_object_get(doc, "config"), "goodput"),
                                                    "ttft_ms")), 150, 0);

    json_t *bad = json_pack("{s:i}", "pdserve_bench_version", 99);
    PD_CHECK_EQ(pd_bench_report_build(&bad, 1, &html, NULL, &err), PD_ERR_INVALID);
    json_decref(bad);
    json_decref(doc);
    for (int i = 0; i < 2; i++) pd_bench_result_free(runs[i]);
}

PD_TEST(report_sweep_and_svg_files) {
    pd_bench_params p = pd_bench_params_default();
    p.base_url = "http://x";
    p.slo.ttft_ms = 150;
    pd_bench_dataset_params dp = pd_bench_dataset_params_default();
    pd_bench_result *a[3] = {fake_result(1, 100), fake_result(2, 120), fake_result(4, 180)};
    pd_bench_result *b[3] = {fake_result(1, 90), fake_result(2, 95), fake_result(4, 110)};
    pd_bench_config ca = {.label = "A", .params = &p, .dataset = &dp}, cb = {.label = "B", .params = &p, .dataset = &dp};
    json_t *docs[2] = {pd_bench_result_to_json(&ca, a, 3), pd_bench_result_to_json(&cb, b, 3)};
    PD_REQUIRE(docs[0] && docs[1]);
    char dir[] = "/tmp/pd_bench_svg_XXXXXX";
    PD_REQUIRE(mkdtemp(dir) != NULL);
    char sub[128];
    snprintf(sub, sizeof sub, "%s/nested/charts", dir);
    char *html = NULL;
    pd_err err = {0};
    PD_REQUIRE(pd_bench_report_build(docs, 2, &html, sub, &err) == PD_OK);
    PD_CHECK_CONTAINS(html, "id=\"p99_ttft_vs_rate\"");
    PD_CHECK_CONTAINS(html, "id=\"goodput_vs_rate\"");
    PD_CHECK_CONTAINS(html, "A @ 2 req/s");  // CDF legend names carry the rate in a sweep
    const char *files[] = {"ttft_cdf", "tpot_cdf", "itl_cdf", "e2e_cdf", "ttft_over_time", "p99_ttft_vs_rate",
                           "p99_tpot_vs_rate", "throughput_vs_rate", "goodput_vs_rate"};
    for (size_t i = 0; i < PD_ARRAY_LEN(files); i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/%s.svg", sub, files[i]);
        char *text = NULL;
        size_t len = 0;
        PD_CHECK_MSG(pd_file_read_all(path, &text, &len, NULL) == PD_OK, "missing %s", path);
        if (text) PD_CHECK(!strncmp(text, "<svg xmlns=\"http://www.w3.org/2000/svg\"", 39));
        pd_free(text);
        unlink(path);
    }
    rmdir(sub);
    snprintf(sub, sizeof sub, "%s/nested", dir);
    rmdir(sub);
    rmdir(dir);
    pd_free(html);
    for (int i = 0; i < 2; i++) json_decref(docs[i]);
    for (int i = 0; i < 3; i++) pd_bench_result_free(a[i]), pd_bench_result_free(b[i]);
}

PD_TEST(svg_render_basics) {
    double x[] = {1, 2, 3}, y[] = {10, 20, 15};
    pd_bench_svg_series s = {.name = "a<b", .x = x, .y = y, .n = 3, .color = "#123456", .has_markers = true};
    pd_bench_svg_chart c = {.title = "T", .x_label = "X", .y_label = "Y", .series = &s, .n_series = 1};
    char *svg = pd_bench_svg_render(&c);
    PD_REQUIRE(svg != NULL);
    PD_CHECK_CONTAINS(svg, "a&lt;b");
    PD_CHECK_CONTAINS(svg, "stroke=\"#123456\"");
    PD_CHECK_CONTAINS(svg, "<circle");
    PD_CHECK_CONTAINS(svg, ">20<");  // a y tick
    PD_CHECK_CONTAINS(svg, "</svg>");
    pd_free(svg);
    c.n_series = 0;  // empty chart still renders
    svg = pd_bench_svg_render(&c);
    PD_CHECK_CONTAINS(svg, "no data");
    pd_free(svg);
}
