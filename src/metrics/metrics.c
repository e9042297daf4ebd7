// metrics.c — the metric registry and Prometheus text rendering (see metrics.h).
//
// Storage: each metric is one pd_malloc'ed struct in a singly linked list kept in creation order.
// Doubles are stored as their bit patterns in _Atomic uint64_t so a reader thread never sees a
// torn value; updates use a compare-exchange loop so even two writers would not lose increments.
// Rendering walks the list once per distinct name (O(n^2) in the number of metrics, which is a
// few dozen), so that the label sets of one name come out together under one HELP/TYPE header as
// the text format requires. pd_metrics_find (on request paths) goes through an index, a pd_map
// (base/map.h) over (name, labels).
#include "metrics/metrics.h"

#include "base/buf.h"
#include "base/map.h"

#include <xxhash.h>

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

struct pd_metric {
    pd_metric *next;
    pd_metric_kind kind;
    char *name;    // owned
    char *help;    // owned
    char *labels;  // owned, NULL = none
    _Atomic uint64_t value_bits;  // counter / gauge value; histogram sum
    _Atomic uint64_t count;       // histogram: number of observations
    int n_bounds;
    double bounds[PD_METRICS_MAX_BUCKETS];
    _Atomic uint64_t buckets[PD_METRICS_MAX_BUCKETS];  // per-bucket (non-cumulative) counts
};

struct pd_metrics {
    pd_metric *head, *tail;
    pd_map index;  // of pd_metric *, by (name, labels)
};

typedef struct mkey {
    const char *name, *labels;
} mkey;

static bool same_labels(const char *a, const char *b);

static bool index_eq(const void *entry, const void *key, void *ctx) {
    const pd_metric *x;
    memcpy(&x, entry, sizeof x);
    const mkey *k = key;
    return !strcmp(x->name, k->name) && same_labels(x->labels, k->labels);
}

static uint64_t index_hash(const char *name, const char *labels) {
    uint64_t h = XXH3_64bits(name, strlen(name));
    return labels && *labels ? h ^ pd_map_mix64(XXH3_64bits(labels, strlen(labels))) : h;
}

const double pd_metrics_latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1.0,    2.5,   5.0,  10.0,  20.0, 40.0, 60.0};
const int pd_metrics_n_latency_buckets = (int)PD_ARRAY_LEN(pd_metrics_latency_buckets);
const double pd_metrics_itl_buckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                         0.05,   0.1,   0.25,   0.5,   1.0,  2.5};
const int pd_metrics_n_itl_buckets = (int)PD_ARRAY_LEN(pd_metrics_itl_buckets);

static inline double bits_to_d(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}
static inline uint64_t d_to_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static void atomic_add_double(_Atomic uint64_t *a, double v) {
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, d_to_bits(bits_to_d(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

pd_metrics *pd_metrics_new(void) {
    pd_metrics *m = pd_calloc(1, sizeof(pd_metrics));
    if (m) PD_ASSERT(pd_map_init(&m->index, &(pd_map_params){.entry_size = sizeof(pd_metric *), .eq = index_eq}) == PD_OK);
    return m;
}

static void metric_free(pd_metric *x) {
    pd_free(x->name);
    pd_free(x->help);
    pd_free(x->labels);
    pd_free(x);
}

void pd_metrics_free(pd_metrics *m) {
    if (!m) return;
    for (pd_metric *x = m->head, *nx; x; x = nx) {
        nx = x->next;
        metric_free(x);
    }
    pd_map_fini(&m->index);
    pd_free(m);
}

static bool name_is_valid(const char *s) {
    if (!s || !*s) return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static bool same_labels(const char *a, const char *b) {
    if (!a || !*a) return !b || !*b;
    return b && !strcmp(a, b);
}

pd_metric *pd_metrics_find(pd_metrics *m, const char *name, const char *labels) {
    if (!name) return NULL;
    pd_metric *const *e = pd_map_find(&m->index, index_hash(name, labels), &(mkey){name, labels});
    return e ? *e : NULL;
}

static pd_metric *add(pd_metrics *m, pd_metric_kind kind, const char *name, const char *help,
                      const char *labels, pd_err *err) {
    if (!name_is_valid(name)) {
        pd_err_set(err, PD_ERR_INVALID, "invalid metric name '%s'", name ? name : "(null)");
        return NULL;
    }
    for (pd_metric *x = m->head; x; x = x->next) {
        if (strcmp(x->name, name)) continue;
        if (x->kind != kind) {
            pd_err_set(err, PD_ERR_INVALID, "metric '%s' registered with another type", name);
            return NULL;
        }
        if (same_labels(x->labels, labels)) {
            pd_err_set(err, PD_ERR_INVALID, "metric '%s{%s}' registered twice", name,
                       labels ? labels : "");
            return NULL;
        }
    }
    pd_metric *x = pd_calloc(1, sizeof *x);
    if (!x) goto oom;
    x->kind = kind;
    x->name = pd_strdup(name);
    x->help = pd_strdup(help ? help : "");
    x->labels = labels && *labels ? pd_strdup(labels) : NULL;
    if (!x->name || !x->help || (labels && *labels && !x->labels)) goto oom;
    // The help text must stay on one line.
    for (char *p = x->help; *p; p++)
        if (*p == '\n') *p = ' ';
    atomic_init(&x->value_bits, d_to_bits(0.0));
    atomic_init(&x->count, 0);
    pd_metric **e = pd_map_put(&m->index, index_hash(x->name, x->labels), &(mkey){x->name, x->labels}, NULL);
    if (!e) goto oom;
    *e = x;
    if (m->tail) m->tail->next = x;
    else m->head = x;
    m->tail = x;
    return x;
oom:
    if (x) metric_free(x);
    pd_err_set(err, PD_ERR_NOMEM, "out of memory registering metric '%s'", name);
    return NULL;
}

pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help, const char *labels,
                              pd_err *err) {
    return add(m, PD_METRIC_COUNTER, name, help, labels, err);
}

pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help, const char *labels,
                            pd_err *err) {
    return add(m, PD_METRIC_GAUGE, name, help, labels, err);
}

pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds,
                                pd_err *err) {
    if (n_bounds <= 0 || n_bounds > PD_METRICS_MAX_BUCKETS || !bounds) {
        pd_err_set(err, PD_ERR_INVALID, "histogram '%s': need 1..%d buckets", name,
                   PD_METRICS_MAX_BUCKETS);
        return NULL;
    }
    for (int i = 0; i < n_bounds; i++) {
        if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
            pd_err_set(err, PD_ERR_INVALID,
                       "histogram '%s': bucket bounds must be finite and strictly increasing", name);
            return NULL;
        }
    }
    pd_metric *x = add(m, PD_METRIC_HISTOGRAM, name, help, labels, err);
    if (!x) return NULL;
    x->n_bounds = n_bounds;
    for (int i = 0; i < n_bounds; i++) {
        x->bounds[i] = bounds[i];
        atomic_init(&x->buckets[i], 0);
    }
    return x;
}

void pd_metric_inc(pd_metric *c, double v) {
    if (!c || !(v >= 0)) return;
    atomic_add_double(&c->value_bits, v);
}

void pd_metric_set(pd_metric *g, double v) {
    if (!g) return;
    atomic_store_explicit(&g->value_bits, d_to_bits(v), memory_order_relaxed);
}

void pd_metric_observe(pd_metric *h, double v) {
    if (!h || h->kind != PD_METRIC_HISTOGRAM || isnan(v)) return;
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i]) i++;
    if (i < h->n_bounds) atomic_fetch_add_explicit(&h->buckets[i], 1, memory_order_relaxed);
    atomic_add_double(&h->value_bits, v);
    atomic_fetch_add_explicit(&h->count, 1, memory_order_relaxed);
}

double pd_metric_value(const pd_metric *x) {
    if (x->kind == PD_METRIC_HISTOGRAM)
        return (double)atomic_load_explicit(&((pd_metric *)x)->count, memory_order_relaxed);
    return bits_to_d(atomic_load_explicit(&((pd_metric *)x)->value_bits, memory_order_relaxed));
}

uint64_t pd_metric_bucket(const pd_metric *h, int i) {
    pd_metric *x = (pd_metric *)h;
    if (i >= x->n_bounds) return atomic_load_explicit(&x->count, memory_order_relaxed);
    uint64_t n = 0;
    for (int j = 0; j <= i; j++) n += atomic_load_explicit(&x->buckets[j], memory_order_relaxed);
    return n;
}

double pd_metric_sum(const pd_metric *h) {
    return bits_to_d(atomic_load_explicit(&((pd_metric *)h)->value_bits, memory_order_relaxed));
}

// ---- rendering ---------------------------------------------------------------------------------

typedef struct rbuf {
    pd_buf s;
    bool oom;
} rbuf;

static void rb_printf(rbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rb_printf(rbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    va_list ap;
    va_start(ap, fmt);
    b->oom = pd_buf_vprintf(&b->s, fmt, ap) != PD_OK;
    va_end(ap);
}

// Formats a sample value the way Prometheus clients do: +Inf/-Inf/NaN, integers without a
// fraction, other values with up to 15 significant digits.
static void fmt_value(char *buf, size_t n, double v) {
    if (isnan(v)) snprintf(buf, n, "NaN");
    else if (isinf(v)) snprintf(buf, n, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15) snprintf(buf, n, "%.0f", v);
    else snprintf(buf, n, "%.15g", v);
}

static const char *kind_name(pd_metric_kind k) {
    return k == PD_METRIC_COUNTER ? "counter" : k == PD_METRIC_GAUGE ? "gauge" : "histogram";
}

static void render_histogram(rbuf *b, const pd_metric *x) {
    const char *l = x->labels ? x->labels : "";
    const char *sep = x->labels ? "," : "";
    char v[64], le[64];
    for (int i = 0; i <= x->n_bounds; i++) {
        if (i < x->n_bounds) fmt_value(le, sizeof le, x->bounds[i]);
        else snprintf(le, sizeof le, "+Inf");
        // A bound like 1 must read "1.0" so that every le value parses as a float label.
        if (i < x->n_bounds && !strpbrk(le, ".eE")) strncat(le, ".0", sizeof le - strlen(le) - 1);
        fmt_value(v, sizeof v, (double)pd_metric_bucket(x, i));
        rb_printf(b, "%s_bucket{%s%sle=\"%s\"} %s\n", x->name, l, sep, le, v);
    }
    fmt_value(v, sizeof v, pd_metric_sum(x));
    rb_printf(b, "%s_sum%s%s%s %s\n", x->name, x->labels ? "{" : "", l, x->labels ? "}" : "", v);
    fmt_value(v, sizeof v, pd_metric_value(x));
    rb_printf(b, "%s_count%s%s%s %s\n", x->name, x->labels ? "{" : "", l, x->labels ? "}" : "", v);
}

pd_status pd_metrics_render(const pd_metrics *m, char **out, size_t *out_len) {
    rbuf b = {0};
    if (pd_buf_reserve(&b.s, 4096) != PD_OK) return PD_ERR_NOMEM;
    for (const pd_metric *x = m->head; x; x = x->next) {
        // Emit each name once, at its first registration, with all its label sets.
        bool seen = false;
        for (const pd_metric *y = m->head; y != x; y = y->next)
            if (!strcmp(y->name, x->name)) seen = true;
        if (seen) continue;
        rb_printf(&b, "# HELP %s %s\n# TYPE %s %s\n", x->name, x->help, x->name, kind_name(x->kind));
        for (const pd_metric *y = x; y; y = y->next) {
            if (strcmp(y->name, x->name)) continue;
            if (y->kind == PD_METRIC_HISTOGRAM) {
                render_histogram(&b, y);
            } else {
                char v[64];
                fmt_value(v, sizeof v, pd_metric_value(y));
                if (y->labels) rb_printf(&b, "%s{%s} %s\n", y->name, y->labels, v);
                else rb_printf(&b, "%s %s\n", y->name, v);
            }
        }
    }
    if (b.oom) {
        pd_buf_free(&b.s);
        return PD_ERR_NOMEM;
    }
    if (out_len) *out_len = b.s.len;
    *out = pd_buf_take(&b.s);
    return PD_OK;
}
