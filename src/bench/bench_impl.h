// bench_impl.h — helpers shared inside src/bench only: a growable text buffer for the JSON-free
// outputs (summary, SVG, HTML). Not part of the module's API.
#pragma once

#include <stdarg.h>

#include "base/base.h"
#include "base/buf.h"

// A pd_buf (base/buf.h) with a sticky OOM flag. Zero-initialise; on OOM it sets is_oom, drops
// further appends and pd_bench_buf_take returns NULL (so callers check once, at the end).
typedef struct pd_bench_buf {
    pd_buf b;
    bool is_oom;
} pd_bench_buf;

void pd_bench_buf_append(pd_bench_buf *b, const char *s, size_t n);
void pd_bench_buf_puts(pd_bench_buf *b, const char *s);
void pd_bench_buf_printf(pd_bench_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Appends s with &, <, >, " and ' escaped for HTML/XML text and attributes.
void pd_bench_buf_escape(pd_bench_buf *b, const char *s);
// The string (owned by the caller, pd_free), or NULL on OOM; b is reset either way.
char *pd_bench_buf_take(pd_bench_buf *b);
void pd_bench_buf_fini(pd_bench_buf *b);
