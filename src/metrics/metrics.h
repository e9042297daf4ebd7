// metrics — counters, gauges and fixed-bucket histograms, rendered in the Prometheus text
// exposition format (version 0.0.4) for GET /metrics.
//
// A pd_metrics is a registry: it owns every metric created through it, in creation order, and
// renders them grouped by name (one # HELP / # TYPE block per name, however many label sets).
// Names follow pdserve_<subsystem>_<name>_<unit> (pdserve_time_to_first_token_seconds,
// pdserve_request_success_total); the registry does not enforce it but rejects names that are not
// valid Prometheus names and a name registered twice with the same labels or a different type.
//
// Labels: a metric has at most one fixed label set, given as the text that goes between the
// braces ("finish_reason=\"stop\""); a "family" is just several metrics that share a name.
//
// Thread safety: values are C11 atomics, so one writer thread (the HTTP event loop) may update
// while another thread renders. Histogram sum and bucket counts are updated one atomic at a time:
// a concurrent render may see an observation in some buckets and not yet in others (Prometheus
// tolerates this; with one writer and the renderer on the same thread, as in the server, it never
// happens). Creating metrics is NOT thread-safe: register everything before sharing the registry.
//
// Ownership: metric handles are owned by the registry and valid until pd_metrics_free. Rendered
// text is owned by the caller.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_metrics pd_metrics;
typedef struct pd_metric pd_metric;  // a counter, gauge or histogram

typedef enum pd_metric_kind {
    PD_METRIC_COUNTER = 1,
    PD_METRIC_GAUGE = 2,
    PD_METRIC_HISTOGRAM = 3,
} pd_metric_kind;

#define PD_METRICS_MAX_BUCKETS 32

// out: owned by caller (pd_metrics_free). NULL on OOM.
pd_metrics *pd_metrics_new(void);
// Frees the registry and every metric in it. NULL is a no-op.
void pd_metrics_free(pd_metrics *m);

// Registers a metric. name: [a-zA-Z_:][a-zA-Z0-9_:]*; help: one line (copied); labels: NULL or
// the label text without braces (copied, e.g. "status=\"200\"").
// Returns the metric (owned by m), or NULL with err set:
//   PD_ERR_INVALID  bad name, same name+labels registered already, same name with another kind,
//                   or (histograms) buckets not strictly increasing / more than
//                   PD_METRICS_MAX_BUCKETS / none
//   PD_ERR_NOMEM
pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help, const char *labels,
                              pd_err *err);
pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help, const char *labels,
                            pd_err *err);
// bounds: n_bounds finite upper bounds (le), strictly increasing; +Inf is implicit.
pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds,
                                pd_err *err);

// The registered metric with this name and labels (NULL labels = none), or NULL.
pd_metric *pd_metrics_find(pd_metrics *m, const char *name, const char *labels);

// Counters: add v >= 0 (negative or NaN values are ignored: counters only go up).
void pd_metric_inc(pd_metric *c, double v);
// Gauges: set to v.
void pd_metric_set(pd_metric *g, double v);
// Histograms: record one observation.
void pd_metric_observe(pd_metric *h, double v);

// Current value of a counter or gauge; for a histogram, the observation count.
double pd_metric_value(const pd_metric *x);
// Histogram: observations <= bounds[i] (cumulative, i < n_bounds) or, for i == n_bounds, all.
uint64_t pd_metric_bucket(const pd_metric *h, int i);
double pd_metric_sum(const pd_metric *h);

// Renders every metric in the text format. *out: owned by caller (pd_free), NUL-terminated;
// *out_len (may be NULL) excludes the NUL. PD_OK or PD_ERR_NOMEM.
pd_status pd_metrics_render(const pd_metrics *m, char **out, size_t *out_len);

// Default latency bucket bounds in seconds (1 ms .. 60 s, roughly x2.5 steps) for TTFT and e2e.
extern const double pd_metrics_latency_buckets[];
extern const int pd_metrics_n_latency_buckets;
// Default bounds for inter-token latency (0.5 ms .. 2.5 s).
extern const double pd_metrics_itl_buckets[];
extern const int pd_metrics_n_itl_buckets;

#ifdef __cplusplus
}
#endif
