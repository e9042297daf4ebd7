// buf.c — pd_bench_buf, the growable string behind the summary table, the SVG charts and the
// HTML report (see bench_impl.h).
#include <stdio.h>
#include <string.h>

#include "bench/bench_impl.h"

void pd_bench_buf_append(pd_bench_buf *b, const char *s, size_t n) {
    if (b->is_oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t ncap = b->cap ? b->cap : 1024;
        while (ncap < b->len + n + 1) ncap *= 2;
        char *ns = pd_realloc(b->s, ncap);
        if (!ns) {
            b->is_oom = true;
            return;
        }
        b->s = ns;
        b->cap = ncap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

void pd_bench_buf_puts(pd_bench_buf *b, const char *s) { pd_bench_buf_append(b, s, strlen(s)); }

void pd_bench_buf_printf(pd_bench_buf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        pd_bench_buf_append(b, small, (size_t)n);
        return;
    }
    char *big = pd_malloc((size_t)n + 1);
    if (!big) {
        b->is_oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    pd_bench_buf_append(b, big, (size_t)n);
    pd_free(big);
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
    char *s = b->is_oom ? NULL : b->s;
    if (!s && !b->is_oom) s = pd_strdup("");
    if (b->is_oom) pd_free(b->s);
    *b = (pd_bench_buf){0};
    return s;
}

void pd_bench_buf_fini(pd_bench_buf *b) {
    pd_free(b->s);
    *b = (pd_bench_buf){0};
}
