// buf.c — see buf.h.
#include "base/buf.h"

#include <stdio.h>
#include <string.h>

pd_status pd_buf_reserve(pd_buf *b, size_t extra) {
    size_t need;
    if (pd_add_overflow(b->len, extra, &need) || pd_add_overflow(need, 1, &need)) return PD_ERR_NOMEM;
    if (b->p && need <= b->cap) return PD_OK;
    size_t cap = b->cap > SIZE_MAX / 2 ? need : PD_MAX(b->cap * 2, need);  // doubling, or exactly
    if (cap < 32) cap = 32;                                                    // a bigger need
    char *p = pd_realloc(b->p, cap);
    if (!p) return PD_ERR_NOMEM;
    if (!b->p) p[0] = 0;
    b->p = p;
    b->cap = cap;
    return PD_OK;
}

pd_status pd_buf_append(pd_buf *b, const void *data, size_t n) {
    pd_status st = pd_buf_reserve(b, n);
    if (st != PD_OK) return st;
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
    return PD_OK;
}

pd_status pd_buf_append_str(pd_buf *b, const char *s) { return pd_buf_append(b, s, strlen(s)); }

pd_status pd_buf_putc(pd_buf *b, char c) { return pd_buf_append(b, &c, 1); }

pd_status pd_buf_vprintf(pd_buf *b, const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap2);
    va_end(ap2);
    if (n < 0) return PD_ERR_INVALID;
    if ((size_t)n < sizeof small) return pd_buf_append(b, small, (size_t)n);
    pd_status st = pd_buf_reserve(b, (size_t)n);
    if (st != PD_OK) return st;
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    b->len += (size_t)n;
    return PD_OK;
}

pd_status pd_buf_printf(pd_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pd_status st = pd_buf_vprintf(b, fmt, ap);
    va_end(ap);
    return st;
}

void pd_buf_truncate(pd_buf *b, size_t len) {
    PD_ASSERT(len <= b->len);
    b->len = len;
    if (b->p) b->p[len] = 0;
}

char *pd_buf_take(pd_buf *b) {
    char *p = b->p ? b->p : pd_strdup("");
    if (p) memset(b, 0, sizeof *b);
    return p;
}

void pd_buf_free(pd_buf *b) {
    pd_free(b->p);
    memset(b, 0, sizeof *b);
}

pd_status pd_array_reserve(void *pptr, size_t elem, size_t *cap, size_t need) {
    if (need <= *cap) return PD_OK;
    size_t c = *cap > SIZE_MAX / 2 ? need : PD_MAX(*cap * 2, need);  // doubling, or exactly a bigger need
    if (c < 4) c = 4;
    size_t bytes;
    if (pd_mul_overflow(c, elem, &bytes)) {
        c = need;  // doubling overflowed: try exactly what was asked
        if (pd_mul_overflow(c, elem, &bytes)) return PD_ERR_NOMEM;
    }
    void *p;
    memcpy(&p, pptr, sizeof p);
    void *np = pd_realloc(p, bytes);
    if (!np) return PD_ERR_NOMEM;
    memcpy(pptr, &np, sizeof np);
    *cap = c;
    return PD_OK;
}
