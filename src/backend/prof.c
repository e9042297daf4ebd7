// prof.c — the op profiler (backend.h pd_backend_prof_begin): device events and host clock
// readings around every op of a forward pass, aggregated per op and shape. Measurements only:
// bench-engine runs one profiled step after its timed ones (PD_CUDA_PROF=1), so the events
// (which also stop programmatic dependent launch from overlapping two kernels) never touch a
// timed figure.
#include "backend/backend_impl.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

typedef struct prof_op {
    char key[64];
    double flops;    // 0: not a GEMM
    int64_t h0, h1;  // host clock around the call (us)
    int e0, e1;      // events before / after
} prof_op;

typedef struct prof_state {
    pd_backend *b;
    int64_t h_begin;
    int n_events;
    prof_op *ops;
    size_t n_ops, cap_ops;
} prof_state;

// The one profile in progress (NULL: none). Written only by begin / end, which a measuring
// program calls from the thread that runs the ops.
static prof_state *g_prof;

bool pd_backend_prof_begin(pd_backend *b) {
    if (!b->iface->prof_record || !b->iface->prof_ms || g_prof) return false;
    prof_state *p = pd_calloc(1, sizeof *p);
    if (!p) return false;
    p->b = b;
    p->h_begin = pd_time_us();
    b->iface->prof_record(b, p->n_events++);  // event 0: where the device stands at begin
    g_prof = p;
    return true;
}

// Starts op i (returns its index, -1 when not profiling b).
int pd_backend_prof_op_begin(pd_backend *b, double flops, const char *fmt, ...) {
    prof_state *p = g_prof;
    if (!p || p->b != b) return -1;
    if (PD_ARRAY_RESERVE(p->ops, p->cap_ops, p->n_ops + 1) != PD_OK) return -1;
    prof_op *o = &p->ops[p->n_ops];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->key, sizeof o->key, fmt, ap);
    va_end(ap);
    o->flops = flops;
    o->h0 = pd_time_us();
    o->e0 = p->n_events++;
    b->iface->prof_record(b, o->e0);
    return (int)p->n_ops++;
}

void pd_backend_prof_op_end(pd_backend *b, int i) {
    prof_state *p = g_prof;
    if (i < 0 || !p || p->b != b) return;
    prof_op *o = &p->ops[i];
    o->e1 = p->n_events++;
    b->iface->prof_record(b, o->e1);
    o->h1 = pd_time_us();
}

typedef struct prof_agg {
    const char *key;
    int n;
    double flops, dev, gap, host;
    double *t;  // per call, in order
} prof_agg;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void pd_backend_prof_end(pd_backend *b, FILE *out, const char *title) {
    prof_state *p = g_prof;
    if (!p || p->b != b) return;
    g_prof = NULL;
    pd_backend_sync(b);
    int64_t h_end = pd_time_us();
    size_t n = p->n_ops, n_ag = 0;
    prof_agg *ag = pd_calloc(n + 1, sizeof *ag);
    double *dev = pd_calloc(n + 1, sizeof(double)), *times = pd_calloc(n + 1, sizeof(double));
    size_t *ki = pd_calloc(n + 1, sizeof(size_t));
    if (!ag || !dev || !times || !ki) n = 0;
    double sum_dev = 0, sum_gap = 0, sum_host = 0, prev_end = 0;  // device ms since event 0
    for (size_t i = 0; i < n; i++) {  // per op: its device time, the idle time before it, its key
        prof_op *o = &p->ops[i];
        double s = b->iface->prof_ms(b, 0, o->e0), e = b->iface->prof_ms(b, 0, o->e1);
        double gap = (s - prev_end) * 1e3, host = (double)(o->h1 - o->h0);  // us
        dev[i] = (e - s) * 1e3;
        prev_end = e;
        size_t k = 0;
        while (k < n_ag && strcmp(ag[k].key, o->key)) k++;
        if (k == n_ag) ag[n_ag++].key = o->key;
        ki[i] = k;
        prof_agg *a = &ag[k];
        a->n++;
        a->flops += o->flops, a->dev += dev[i], a->gap += gap, a->host += host;
        sum_dev += dev[i], sum_gap += gap, sum_host += host;
    }
    for (size_t k = 0, off = 0; k < n_ag; k++) ag[k].t = times + off, off += (size_t)ag[k].n, ag[k].n = 0;
    for (size_t i = 0; i < n; i++) ag[ki[i]].t[ag[ki[i]].n++] = dev[i];  // each key's calls in order
    if (!out) n_ag = 0, n = 0;  // nothing printed (a warm-up profile)
    if (out) fprintf(out, "prof %s: %zu ops; per op and shape: calls, device us (sum; min / median / max; mean of the first / last "
                 "quarter), idle before (sum), host in the calls (sum)\n", title, n);
    for (size_t k = 0; k < n_ag; k++) {
        prof_agg *a = &ag[k];
        int q = a->n >= 4 ? a->n / 4 : 1;  // the first and the last quarter of the calls: drift (clocks)
        double first = 0, last = 0;
        for (int j = 0; j < q; j++) first += a->t[j] / q, last += a->t[a->n - 1 - j] / q;
        qsort(a->t, (size_t)a->n, sizeof(double), cmp_double);
        fprintf(out, "prof   %-44s %4d %10.1f us; %8.1f / %8.1f / %8.1f; %8.1f / %8.1f  idle %8.1f  host %8.1f", a->key,
                a->n, a->dev, a->t[0], a->t[a->n / 2], a->t[a->n - 1], first, last, a->gap, a->host);
        if (a->flops > 0) fprintf(out, "  %6.1f TFLOP/s", a->flops / (a->dev * 1e6));
        fprintf(out, "\n");
    }
    double h_first = n ? (double)(p->ops[0].h0 - p->h_begin) : 0, h_last = n ? (double)(p->ops[n - 1].h1 - p->h_begin) : 0;
    if (out) fprintf(out, "prof %s totals: ops %.1f us + idle before them %.1f us = device %.1f us (begin to the last op's end); "
                 "host: begin to the first op %.1f us, to the last op's return %.1f us (in the calls %.1f), to the end "
                 "(after the sync) %.1f us\n",
            title, sum_dev, sum_gap, prev_end * 1e3, h_first, h_last, sum_host, (double)(h_end - p->h_begin));
    pd_free(ki);
    pd_free(times);
    pd_free(dev);
    pd_free(ag);
    pd_free(p->ops);
    pd_free(p);
}
