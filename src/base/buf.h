// buf — the one growable buffer of pdserve: a byte string (pd_buf) and a checked growth rule for
// typed arrays (pd_array_reserve).
//
// Every size is overflow-checked (lengths often come from outside: a body, a prompt, a file), and
// all memory comes from pd_malloc & co, so the fault tier walks these allocation sites too. A
// failed call changes nothing: the old contents stay valid and owned by the caller.
//
// pd_buf: {p, len, cap}, zero-initialised is an empty buffer. Once it holds anything, p[len] is
// a NUL (cap counts it), so p is a C string whenever the contents have no NUL bytes of their own.
// Growth: the larger of double and the need (at least 32 bytes), so appending n bytes one at a
// time costs O(n) and one big append allocates no more than it needs.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_buf {
    char *p;     // owned; NULL until the first growth
    size_t len;  // bytes of content
    size_t cap;  // bytes allocated (>= len + 1 once p != NULL)
} pd_buf;

// Room for `extra` more bytes of content (and the NUL). PD_ERR_NOMEM on overflow or OOM.
pd_status pd_buf_reserve(pd_buf *b, size_t extra);
pd_status pd_buf_append(pd_buf *b, const void *data, size_t n);
pd_status pd_buf_append_str(pd_buf *b, const char *s);
pd_status pd_buf_putc(pd_buf *b, char c);
pd_status pd_buf_printf(pd_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
pd_status pd_buf_vprintf(pd_buf *b, const char *fmt, va_list ap);
// Empties the buffer, keeps the allocation.
static inline void pd_buf_clear(pd_buf *b) {
    b->len = 0;
    if (b->p) b->p[0] = 0;
}
// Cuts the content to its first len bytes (len <= b->len).
void pd_buf_truncate(pd_buf *b, size_t len);
// Hands the contents to the caller (pd_free) and leaves the buffer empty. Never NULL unless out
// of memory: an empty buffer yields an allocated "".
char *pd_buf_take(pd_buf *b);
void pd_buf_free(pd_buf *b);

// Typed arrays kept as `T *arr; size_t n, cap;`: makes *pptr (a T *) hold at least `need`
// elements of elem bytes, growing to the larger of double the capacity
// and need (at least 4 elements). Contents are kept; new
// elements are uninitialised. PD_ERR_NOMEM (nothing changed) on overflow or OOM.
pd_status pd_array_reserve(void *pptr, size_t elem, size_t *cap, size_t need);
#define PD_ARRAY_RESERVE(arr, cap, need) pd_array_reserve(&(arr), sizeof *(arr), &(cap), (need))

#ifdef __cplusplus
}
#endif
