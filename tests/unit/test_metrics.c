// test_metrics.c — the metric registry: registration rules, counter/gauge/histogram semantics and
// the exact Prometheus text rendering (grouping of label sets under one HELP/TYPE, cumulative
// buckets, +Inf, _sum/_count, number formatting), plus a writer thread racing a reader.
#include "test.h"

#include <pthread.h>

#include "metrics/metrics.h"

PD_TEST(registration_rules) {
    pd_metrics *m = pd_metrics_new();
    pd_err err = {0};
    PD_CHECK(pd_metrics_counter(m, "pdserve_x_total", "x", NULL, &err) != NULL);
    PD_CHECK(pd_metrics_counter(m, "pdserve_x_total", "x", NULL, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK(pd_metrics_counter(m, "pdserve_x_total", "x", "a=\"1\"", &err) != NULL);
    PD_CHECK(pd_metrics_gauge(m, "pdserve_x_total", "x", "a=\"2\"", &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "another type");
    PD_CHECK(pd_metrics_gauge(m, "9bad", "x", NULL, &err) == NULL);
    PD_CHECK(pd_metrics_gauge(m, "bad-name", "x", NULL, &err) == NULL);
    PD_CHECK(pd_metrics_gauge(m, "", "x", NULL, &err) == NULL);
    double nb[] = {1, 1};
    PD_CHECK(pd_metrics_histogram(m, "pdserve_h", "h", NULL, nb, 2, &err) == NULL);
    PD_CHECK(pd_metrics_histogram(m, "pdserve_h", "h", NULL, nb, 0, &err) == NULL);
    PD_CHECK(pd_metrics_find(m, "pdserve_x_total", NULL) != NULL);
    PD_CHECK(pd_metrics_find(m, "pdserve_x_total", "a=\"1\"") != NULL);
    PD_CHECK(pd_metrics_find(m, "pdserve_x_total", "a=\"3\"") == NULL);
    pd_metrics_free(m);
    pd_metrics_free(NULL);
}

PD_TEST(values) {
    pd_metrics *m = pd_metrics_new();
    pd_metric *c = pd_metrics_counter(m, "c_total", "c", NULL, NULL);
    pd_metric *g = pd_metrics_gauge(m, "g", "g", NULL, NULL);
    pd_metric_inc(c, 2);
    pd_metric_inc(c, 0.5);
    pd_metric_inc(c, -4);     // ignored
    pd_metric_inc(c, NAN);    // ignored
    PD_CHECK_NEAR(pd_metric_value(c), 2.5, 0);
    pd_metric_set(g, 7);
    pd_metric_set(g, -3);
    PD_CHECK_NEAR(pd_metric_value(g), -3, 0);
    double b[] = {0.1, 1, 10};
    pd_metric *h = pd_metrics_histogram(m, "h_seconds", "h", NULL, b, 3, NULL);
    pd_metric_observe(h, 0.05);
    pd_metric_observe(h, 0.1);  // le is inclusive
    pd_metric_observe(h, 5);
    pd_metric_observe(h, 100);
    PD_CHECK_EQ(pd_metric_bucket(h, 0), 2);
    PD_CHECK_EQ(pd_metric_bucket(h, 1), 2);
    PD_CHECK_EQ(pd_metric_bucket(h, 2), 3);
    PD_CHECK_EQ(pd_metric_bucket(h, 3), 4);
    PD_CHECK_NEAR(pd_metric_sum(h), 105.15, 1e-9);
    PD_CHECK_NEAR(pd_metric_value(h), 4, 0);
    pd_metrics_free(m);
}

PD_TEST(render_exact) {
    pd_metrics *m = pd_metrics_new();
    pd_metric *ok = pd_metrics_counter(m, "pdserve_request_success_total", "Finished requests.",
                                       "finish_reason=\"stop\"", NULL);
    pd_metric *run = pd_metrics_gauge(m, "pdserve_num_requests_running", "Running\nrequests.", NULL, NULL);
    pd_metric *len = pd_metrics_counter(m, "pdserve_request_success_total", "ignored",
                                        "finish_reason=\"length\"", NULL);
    double b[] = {0.5, 1, 2.5};
    pd_metric *h = pd_metrics_histogram(m, "pdserve_e2e_request_latency_seconds", "E2E.", NULL, b, 3, NULL);
    pd_metric_inc(ok, 3);
    pd_metric_inc(len, 1);
    pd_metric_set(run, 0.25);
    pd_metric_observe(h, 0.75);
    pd_metric_observe(h, 3);
    char *s = NULL;
    size_t n = 0;
    PD_REQUIRE(pd_metrics_render(m, &s, &n) == PD_OK);
    const char *want =
        "# HELP pdserve_request_success_total Finished requests.\n"
        "# TYPE pdserve_request_success_total counter\n"
        "pdserve_request_success_total{finish_reason=\"stop\"} 3\n"
        "pdserve_request_success_total{finish_reason=\"length\"} 1\n"
        "# HELP pdserve_num_requests_running Running requests.\n"
        "# TYPE pdserve_num_requests_running gauge\n"
        "pdserve_num_requests_running 0.25\n"
        "# HELP pdserve_e2e_request_latency_seconds E2E.\n"
        "# TYPE pdserve_e2e_request_latency_seconds histogram\n"
        "pdserve_e2e_request_latency_seconds_bucket{le=\"0.5\"} 0\n"
        "pdserve_e2e_request_latency_seconds_bucket{le=\"1.0\"} 1\n"
        "pdserve_e2e_request_latency_seconds_bucket{le=\"2.5\"} 1\n"
        "pdserve_e2e_request_latency_seconds_bucket{le=\"+Inf\"} 2\n"
        "pdserve_e2e_request_latency_seconds_sum 3.75\n"
        "pdserve_e2e_request_latency_seconds_count 2\n";
    PD_CHECK_STR(s, want);
    PD_CHECK_EQ(n, strlen(want));
    pd_free(s);
    pd_metrics_free(m);
}

PD_TEST(render_labelled_histogram_and_oom) {
    pd_metrics *m = pd_metrics_new();
    double b[] = {1};
    pd_metric *h = pd_metrics_histogram(m, "x_seconds", "x", "model=\"m\"", b, 1, NULL);
    pd_metric_observe(h, 2);
    char *s = NULL;
    PD_REQUIRE(pd_metrics_render(m, &s, NULL) == PD_OK);
    PD_CHECK_CONTAINS(s, "x_seconds_bucket{model=\"m\",le=\"1.0\"} 0\n");
    PD_CHECK_CONTAINS(s, "x_seconds_bucket{model=\"m\",le=\"+Inf\"} 1\n");
    PD_CHECK_CONTAINS(s, "x_seconds_sum{model=\"m\"} 2\n");
    PD_CHECK_CONTAINS(s, "x_seconds_count{model=\"m\"} 1\n");
    pd_free(s);
    // Every allocation failure in render is reported, never a crash or a leak.
    for (long k = 0; k < 4; k++) {
        pd_mem_fault_set(k, true);
        s = NULL;
        pd_status st = pd_metrics_render(m, &s, NULL);
        pd_mem_fault_set(-1, false);
        if (st == PD_OK) pd_free(s);
        else PD_CHECK_EQ(st, PD_ERR_NOMEM);
    }
    pd_metrics_free(m);
}

typedef struct race {
    pd_metric *c, *h;
    int n;
} race;

static void *writer(void *arg) {
    race *r = arg;
    for (int i = 0; i < r->n; i++) {
        pd_metric_inc(r->c, 1);
        pd_metric_observe(r->h, 0.001 * (i % 100));
    }
    return NULL;
}

PD_TEST(writer_and_reader_threads) {
    pd_metrics *m = pd_metrics_new();
    double b[] = {0.01, 0.05};
    race r = {pd_metrics_counter(m, "c_total", "c", NULL, NULL),
              pd_metrics_histogram(m, "h_seconds", "h", NULL, b, 2, NULL), 200000};
    pthread_t t;
    pthread_create(&t, NULL, writer, &r);
    double last = 0;
    for (int i = 0; i < 50; i++) {
        char *s = NULL;
        PD_CHECK_EQ(pd_metrics_render(m, &s, NULL), PD_OK);
        pd_free(s);
        double v = pd_metric_value(r.c);
        PD_CHECK(v >= last);  // monotonic as seen by the reader
        last = v;
    }
    pthread_join(t, NULL);
    PD_CHECK_NEAR(pd_metric_value(r.c), 200000, 0);
    PD_CHECK_EQ(pd_metric_bucket(r.h, 2), 200000);
    PD_CHECK_EQ(pd_metric_bucket(r.h, 0), 2 * 11 * 1000);  // i%100 in 0..10 → <= 0.01
    pd_metrics_free(m);
}
