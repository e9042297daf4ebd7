// svg.c — line charts as self-contained SVG text: axes with "nice" ticks (1-2-5 steps, or decades
// on a log axis), light grid, one polyline per series (optionally as steps, for CDFs), markers
// with hover titles, and a legend placed in whichever corner of the plot holds the fewest points.
//
// Layout (pixels):
//   ┌──────────────────────── title ─────────────────────────┐
//   │ y ticks │ plot area (grid, series, legend)             │
//   │         └──────────────────────────────────────────────│
//   │                 x ticks, x label                       │
//   └────────────────────────────────────────────────────────┘
// The output names its font generically (sans-serif) and carries no external reference, so it
// can be inlined in HTML or saved as a .svg file as is.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "bench/bench_impl.h"

static const char *const PALETTE[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

const char *pd_bench_svg_color(int i) {
    return PALETTE[(size_t)(i < 0 ? 0 : i) % PD_ARRAY_LEN(PALETTE)];
}

#define ML 70   // left margin
#define MR 20
#define MT 40
#define MB 52
#define LOG_DECADES 4
#define LEGEND_ROW 17        // pixels per legend line
#define LEGEND_INSIDE_MAX 4  // more series than this: the legend goes below the plot

typedef struct axis {
    double lo, hi;     // data range shown
    bool is_log;
    double ticks[32];
    int n_ticks;
} axis;

static double nice_step(double span, int target) {
    double raw = span / target, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

// Chooses the shown range and ticks for data in [lo, hi].
static void axis_fit(axis *a, double lo, double hi, bool from_zero, bool is_log) {
    a->is_log = is_log && lo > 0;
    a->n_ticks = 0;
    if (a->is_log) {
        double l = floor(log10(lo)), h = ceil(log10(hi));
        if (h <= l) h = l + 1;
        a->lo = pow(10, l);
        a->hi = pow(10, h);
        bool is_fine = h - l <= 2;  // few decades: also label 2x and 5x
        for (double e = l; e <= h && a->n_ticks < 30; e++) {
            a->ticks[a->n_ticks++] = pow(10, e);
            if (is_fine && e < h) a->ticks[a->n_ticks++] = 2 * pow(10, e), a->ticks[a->n_ticks++] = 5 * pow(10, e);
        }
        return;
    }
    if (from_zero && lo > 0) lo = 0;
    if (!(hi > lo)) hi = lo + (lo != 0 ? fabs(lo) : 1);
    double step = nice_step(hi - lo, 5);
    a->lo = floor(lo / step) * step;
    a->hi = ceil(hi / step) * step;
    for (double t = a->lo; t <= a->hi + step * 1e-9 && a->n_ticks < 32; t += step)
        a->ticks[a->n_ticks++] = fabs(t) < step * 1e-9 ? 0 : t;
}

// Position of v along an axis of `len` pixels (0 at lo).
static double axis_pos(const axis *a, double v, double len) {
    if (a->is_log) {
        if (!(v >= a->lo)) v = a->lo;
        return (log10(v) - log10(a->lo)) / (log10(a->hi) - log10(a->lo)) * len;
    }
    return (v - a->lo) / (a->hi - a->lo) * len;
}

static void fmt_tick(char *buf, size_t n, double v) {
    double av = fabs(v);
    if (av >= 1e6 || (av > 0 && av < 1e-3)) snprintf(buf, n, "%.0e", v);
    else if (av >= 100 || v == floor(v)) snprintf(buf, n, "%.0f", v);
    else snprintf(buf, n, "%g", v);
}

// Data ranges over every finite point (x > 0 on a log axis).
static bool data_range(const pd_bench_svg_chart *c, double r[4]) {
    r[0] = r[2] = INFINITY;
    r[1] = r[3] = -INFINITY;
    for (int s = 0; s < c->n_series; s++)
        for (int i = 0; i < c->series[s].n; i++) {
            double x = c->series[s].x[i], y = c->series[s].y[i];
            if (!isfinite(x) || !isfinite(y) || (c->is_log_x && x <= 0)) continue;
            r[0] = fmin(r[0], x), r[1] = fmax(r[1], x), r[2] = fmin(r[2], y), r[3] = fmax(r[3], y);
        }
    // A log axis spans at most LOG_DECADES decades below the largest x; smaller values (e.g. ITL
    // gaps of chunks that arrived in one read) are drawn on its left edge.
    if (c->is_log_x && isfinite(r[0])) r[0] = fmax(r[0], r[1] / pow(10, LOG_DECADES));
    return isfinite(r[0]);
}

static void draw_axes(pd_bench_buf *b, const pd_bench_svg_chart *c, const axis *ax, const axis *ay, double pw,
                      double ph) {
    char t[32];
    pd_bench_buf_printf(b, "<g font-size=\"11\" fill=\"#444\">\n");
    for (int i = 0; i < ay->n_ticks; i++) {
        double y = MT + ph - axis_pos(ay, ay->ticks[i], ph);
        fmt_tick(t, sizeof t, ay->ticks[i]);
        pd_bench_buf_printf(b, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e5e5e5\"/>"
                            "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
                            ML, y, ML + pw, y, ML - 6, y, t);
    }
    for (int i = 0; i < ax->n_ticks; i++) {
        double x = ML + axis_pos(ax, ax->ticks[i], pw);
        fmt_tick(t, sizeof t, ax->ticks[i]);
        pd_bench_buf_printf(b, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e5e5e5\"/>"
                            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                            x, MT, x, MT + ph, x, MT + ph + 16, t);
    }
    pd_bench_buf_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#999\"/>\n",
                        ML, MT, pw, ph);
    pd_bench_buf_printf(b, "</g>\n<g font-size=\"12\" fill=\"#222\">\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">",
                        ML + pw / 2, MT + ph + 38);
    pd_bench_buf_escape(b, c->x_label ? c->x_label : "");
    pd_bench_buf_printf(b, "</text>\n<text transform=\"translate(16 %.1f) rotate(-90)\" text-anchor=\"middle\">",
                        MT + ph / 2);
    pd_bench_buf_escape(b, c->y_label ? c->y_label : "");
    pd_bench_buf_printf(b, "</text>\n<text x=\"%.1f\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"600\">",
                        ML + pw / 2);
    pd_bench_buf_escape(b, c->title ? c->title : "");
    pd_bench_buf_puts(b, "</text>\n</g>\n");
}

// The series as one path (steps for CDFs); a NAN point lifts the pen.
static void draw_path(pd_bench_buf *b, const pd_bench_svg_chart *c, const pd_bench_svg_series *s, const axis *ax,
                      const axis *ay, double pw, double ph) {
    pd_bench_buf_printf(b, "<path fill=\"none\" stroke=\"%s\" stroke-opacity=\"%.2f\" stroke-width=\"2\" "
                        "stroke-linejoin=\"round\"%s d=\"", s->color ? s->color : "#1f77b4",
                        s->opacity > 0 ? s->opacity : 1.0, s->is_dashed ? " stroke-dasharray=\"6 4\"" : "");
    bool pen = false;
    double prev_y = 0;
    for (int i = 0; i < s->n; i++) {
        if (!isfinite(s->x[i]) || !isfinite(s->y[i]) || (ax->is_log && s->x[i] <= 0)) {
            pen = false;
            continue;
        }
        double x = ML + axis_pos(ax, s->x[i], pw), y = MT + ph - axis_pos(ay, s->y[i], ph);
        if (pen && c->is_step) pd_bench_buf_printf(b, "L%.1f %.1f", x, prev_y);
        pd_bench_buf_printf(b, "%s%.1f %.1f", pen ? "L" : "M", x, y);
        pen = true;
        prev_y = y;
    }
    pd_bench_buf_puts(b, "\"/>\n");
}

static void draw_series(pd_bench_buf *b, const pd_bench_svg_chart *c, const pd_bench_svg_series *s,
                        const axis *ax, const axis *ay, double pw, double ph) {
    pd_bench_buf_printf(b, "<g><title>");
    pd_bench_buf_escape(b, s->name ? s->name : "");
    pd_bench_buf_puts(b, "</title>");
    if (!s->is_scatter) draw_path(b, c, s, ax, ay, pw, ph);
    if (s->has_markers || s->is_scatter) {
        for (int i = 0; i < s->n; i++) {
            if (!isfinite(s->x[i]) || !isfinite(s->y[i])) continue;
            double x = ML + axis_pos(ax, s->x[i], pw), y = MT + ph - axis_pos(ay, s->y[i], ph);
            pd_bench_buf_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%s\" fill=\"%s\" fill-opacity=\"%.2f\"><title>",
                                x, y, s->is_scatter ? "2.5" : "3.5", s->color ? s->color : "#1f77b4",
                                s->opacity > 0 ? s->opacity : 1.0);
            pd_bench_buf_escape(b, s->name ? s->name : "");
            pd_bench_buf_printf(b, ": (%g, %g)</title></circle>\n", s->x[i], s->y[i]);
        }
    }
    pd_bench_buf_puts(b, "</g>\n");
}

static size_t longest_name(const pd_bench_svg_chart *c) {
    size_t n = 4;
    for (int s = 0; s < c->n_series; s++) n = PD_MAX(n, strlen(c->series[s].name ? c->series[s].name : ""));
    return PD_MIN(n, 48);
}

// Columns of the legend drawn below the plot (0 when it fits inside).
static int legend_cols(const pd_bench_svg_chart *c, double pw) {
    if (c->n_series <= LEGEND_INSIDE_MAX) return 0;
    int cols = (int)(pw / (40 + 6.6 * (double)longest_name(c)));
    return PD_MAX(1, PD_MIN(cols, 4));
}

static void legend_item(pd_bench_buf *b, const pd_bench_svg_series *se, double x, double y) {
    pd_bench_buf_printf(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-opacity=\"%.2f\" "
                        "stroke-width=\"3\"%s/><text x=\"%.1f\" y=\"%.1f\" dominant-baseline=\"middle\">",
                        x, y, x + 20, y, se->color ? se->color : "#1f77b4", se->opacity > 0 ? se->opacity : 1.0,
                        se->is_dashed ? " stroke-dasharray=\"6 4\"" : "", x + 25, y);
    pd_bench_buf_escape(b, se->name ? se->name : "");
    pd_bench_buf_puts(b, "</text>\n");
}

// Few series: a box in the plot corner that covers the fewest data points. Many: rows of items
// below the x label (the SVG is made taller for them).
static void draw_legend(pd_bench_buf *b, const pd_bench_svg_chart *c, const axis *ax, const axis *ay, double pw,
                        double ph) {
    if (c->n_series == 0) return;
    int cols = legend_cols(c, pw);
    pd_bench_buf_puts(b, "<g font-size=\"11\" fill=\"#222\">\n");
    if (cols > 0) {
        double col_w = pw / cols;
        for (int s = 0; s < c->n_series; s++)
            legend_item(b, &c->series[s], ML + col_w * (s % cols), MT + ph + MB + LEGEND_ROW * (s / cols));
        pd_bench_buf_puts(b, "</g>\n");
        return;
    }
    double lw = 34 + 6.6 * (double)longest_name(c), lh = 8 + (double)LEGEND_ROW * c->n_series;
    double best_x = ML + pw - lw - 8, best_y = MT + 8;
    int best = -1;
    for (int corner = 0; corner < 4; corner++) {
        double bx = corner & 1 ? ML + 8 : ML + pw - lw - 8, by = corner & 2 ? MT + ph - lh - 8 : MT + 8;
        int n_in = 0;
        for (int s = 0; s < c->n_series; s++)
            for (int i = 0; i < c->series[s].n; i++) {
                double x = ML + axis_pos(ax, c->series[s].x[i], pw), y = MT + ph - axis_pos(ay, c->series[s].y[i], ph);
                n_in += x >= bx && x <= bx + lw && y >= by && y <= by + lh;
            }
        if (best < 0 || n_in < best) best = n_in, best_x = bx, best_y = by;
    }
    pd_bench_buf_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fff\" fill-opacity=\"0.85\" "
                        "stroke=\"#ccc\" rx=\"3\"/>\n", best_x, best_y, lw, lh);
    for (int s = 0; s < c->n_series; s++) legend_item(b, &c->series[s], best_x + 6, best_y + 13 + (double)LEGEND_ROW * s);
    pd_bench_buf_puts(b, "</g>\n");
}

char *pd_bench_svg_render(const pd_bench_svg_chart *c) {
    int w = c->width > 0 ? c->width : 640, h = c->height > 0 ? c->height : 400;
    double pw = w - ML - MR, ph = h - MT - MB;
    int cols = legend_cols(c, pw);
    if (cols > 0) h += 8 + LEGEND_ROW * ((c->n_series + cols - 1) / cols);  // room for the legend below
    pd_bench_buf b = {0};
    pd_bench_buf_printf(&b, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
                        "font-family=\"-apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\" role=\"img\">\n"
                        "<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n", w, h, w, h, w, h);
    double r[4];
    axis ax, ay;
    if (!data_range(c, r)) {
        axis_fit(&ax, 0, 1, true, false);
        axis_fit(&ay, 0, 1, true, false);
        draw_axes(&b, c, &ax, &ay, pw, ph);
        pd_bench_buf_printf(&b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#888\" font-size=\"13\">no data</text>\n",
                            ML + pw / 2, MT + ph / 2);
    } else {
        axis_fit(&ax, r[0], r[1], !c->is_log_x, c->is_log_x);
        axis_fit(&ay, r[2], r[3], true, false);
        draw_axes(&b, c, &ax, &ay, pw, ph);
        for (int s = 0; s < c->n_series; s++) draw_series(&b, c, &c->series[s], &ax, &ay, pw, ph);
        draw_legend(&b, c, &ax, &ay, pw, ph);
    }
    pd_bench_buf_puts(&b, "</svg>\n");
    return pd_bench_buf_take(&b);
}
