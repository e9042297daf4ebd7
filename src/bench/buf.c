// buf.c — pd_bench_buf, the growable string behind the summary table, the SVG charts and the
// HTML report (see bench_impl.h).
#include <stdio.h>
#include <string.h>

#include "bench/bench_impl.h"

void pd_bench_buf_append(pd_bench_buf *b, const char *s, size_t n) {
    if (!b->is_oom && pd_buf_append(&b->b, s, n) != PD_OK) b->is_oom = true;
}

void pd_bench_buf_puts(pd_bench_buf *b, const char *s) { pd_bench_buf_append(b, s, strlen(s)); }

void pd_bench_buf_printf(pd_bench_buf *b, const char *fmt, ...) {
    if (b->is_oom) return;
    va_list ap;
    va_start(ap, fmt);
    if (pd_buf_vprintf(&b->b, fmt, ap) == PD_ERR_NOMEM) b->is_oom = true;
    va_end(ap);
}

void pd_bench_buf_escape(pd_bench_buf *b, const char *s) {
    for (const char *p = s; p && *p; p++) {
        switch (*p) {
        case '&': pd_bench_buf_puts(b, "&amp;"); break;
        case '<': pd_bench_buf_puts(b, "&lt;"); break;
        case '>': pd_bench_buf_puts(b, "&gt;"); break;
        case '"': pd_bench_buf_puts(b, "&quot;"); break;
        case '\'': pd_bench_buf_puts(b, "&#39;"); break;
        default: pd_bench_buf_append(b, p, 1); break;
        }
    }
}

char *pd_bench_buf_take(pd_bench_buf *b) {
    char *s = b->is_oom ? NULL : pd_buf_take(&b->b);
    pd_bench_buf_fini(b);
    return s;
}

void pd_bench_buf_fini(pd_bench_buf *b) {
    pd_buf_free(&b->b);
    b->is_oom = false;
}
