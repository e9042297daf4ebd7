// jinja_value.c — the value model of the Jinja engine: Python semantics over jansson values.
//
// What lives here: the template arena, the bounded output buffer, jv reference handling, UTF-8
// helpers, and everything that must print or compare values exactly as CPython does —
// str()/repr() of None/bools/ints/floats/lists/dicts, float repr (shortest round-trip digits,
// exponent form below 1e-4 and from 1e16), json.dumps as transformers' tojson calls it
// (ensure_ascii=False, lowercase \u00XX for control characters, Infinity/NaN), == with int/float
// cross-equality and order-insensitive dicts, and < on numbers, strings and lists.
//
// Nested values (lists in dicts in lists...) are walked recursively; JJ_MAX_VALUE_DEPTH bounds the
// recursion so a deeply nested request body cannot exhaust the stack.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok/jinja_impl.h"

#define JJ_MAX_VALUE_DEPTH 256
#define JJ_CHUNK_HDR 32
#define JJ_CHUNK_MIN (64 * 1024)

// ---- arena ----------------------------------------------------------------------------------------
struct jj_chunk {
    jj_chunk *next;
    size_t used, cap;
};

void *jj_arena_alloc(jj_arena *a, size_t n_bytes) {
    size_t n = (n_bytes + 15) & ~(size_t)15;
    if (n < n_bytes) return NULL;
    jj_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > JJ_CHUNK_MIN ? n : JJ_CHUNK_MIN;
        c = pd_malloc(JJ_CHUNK_HDR + cap);
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    unsigned char *p = (unsigned char *)c + JJ_CHUNK_HDR + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *jj_arena_strndup(jj_arena *a, const char *s, size_t n) {
    char *p = jj_arena_alloc(a, n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void jj_arena_fini(jj_arena *a) {
    jj_chunk *c = a->head;
    while (c) {
        jj_chunk *next = c->next;
        pd_free(c);
        c = next;
    }
    a->head = NULL;
}

// ---- buffer ---------------------------------------------------------------------------------------
void jj_buf_init(jj_buf *b, size_t limit) {
    memset(b, 0, sizeof *b);
    b->limit = limit;
}

bool jj_buf_put(jj_buf *b, const char *s, size_t n) {
    if (b->s.len + n > b->limit || b->s.len + n < b->s.len) {
        b->is_over = true;
        return false;
    }
    if (pd_buf_append(&b->s, s, n) != PD_OK) {
        b->is_nomem = true;
        return false;
    }
    return true;
}

bool jj_buf_putc(jj_buf *b, char c) { return jj_buf_put(b, &c, 1); }

bool jj_buf_puts(jj_buf *b, const char *s) { return jj_buf_put(b, s, strlen(s)); }

bool jj_buf_printf(jj_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) return false;  // only used for short numbers
    return jj_buf_put(b, tmp, (size_t)n);
}

char *jj_buf_take(jj_buf *b, size_t *len) {
    size_t n = b->s.len;
    char *p = pd_buf_take(&b->s);
    if (p && len) *len = n;
    return p;
}

void jj_buf_fini(jj_buf *b) { pd_buf_free(&b->s); }

// ---- errors ---------------------------------------------------------------------------------------
bool jj_fail(jj_render *r, pd_status status, const char *fmt, ...) {
    if (r->status != PD_OK) return false;
    r->status = status;
    if (r->err) {
        char msg[sizeof r->err->msg];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        pd_err_set(r->err, status, "%s", msg);
    }
    return false;
}

bool jj_fail_nomem(jj_render *r) { return jj_fail(r, PD_ERR_NOMEM, "out of memory rendering template"); }

bool jj_fail_buf(jj_render *r, const jj_buf *b) {
    if (b->is_nomem) return jj_fail_nomem(r);
    return jj_fail(r, PD_ERR_INVALID, "template output exceeds the limit of %zu bytes",
                   r->lim.max_output_bytes);
}

bool jj_str_new(jj_render *r, const char *s, size_t n, jv *out) {
    if (n > r->lim.max_output_bytes)
        return jj_fail(r, PD_ERR_INVALID, "template string exceeds the limit of %zu bytes",
                       r->lim.max_output_bytes);
    json_t *j = json_stringn_nocheck(s ? s : "", n);
    if (!j) return jj_fail_nomem(r);
    *out = (jv){.kind = JV_STR};
    out->u.j = j;
    return true;
}

bool jj_str_from_buf(jj_render *r, jj_buf *b, jv *out) {
    if (b->is_over || b->is_nomem) {
        jj_fail_buf(r, b);
        jj_buf_fini(b);
        return false;
    }
    bool ok = jj_str_new(r, b->s.p, b->s.len, out);
    jj_buf_fini(b);
    return ok;
}

// ---- jv -------------------------------------------------------------------------------------------
static void obj_release(jj_obj *o) {
    if (--o->refcount > 0) return;
    if (o->type == JV_FUNC) {
        jj_func *f = (jj_func *)o;
        jv_drop(&f->self);
    } else {
        jj_loop *l = (jj_loop *)o;
        json_decref(l->items);
    }
    pd_free(o);
}

void jv_drop(jv *v) {
    if (v->is_borrowed) {
        *v = jv_undef(NULL);
        return;
    }
    switch (v->kind) {
    case JV_STR: case JV_LIST: case JV_DICT: case JV_NS: json_decref(v->u.j); break;
    case JV_FUNC: case JV_LOOP: obj_release(v->u.o); break;
    default: break;
    }
    *v = jv_undef(NULL);
}

jv jv_copy(const jv *v) {
    if (v->is_borrowed) return *v;
    switch (v->kind) {
    case JV_STR: case JV_LIST: case JV_DICT: case JV_NS: json_incref(v->u.j); break;
    case JV_FUNC: case JV_LOOP: v->u.o->refcount++; break;
    default: break;
    }
    return *v;
}

// A view of j that holds no reference (never jv_drop it).
static jv jv_peek(json_t *j) {
    jv v = jv_undef(NULL);
    if (!j) return v;
    switch (json_typeof(j)) {
    case JSON_OBJECT: v.kind = JV_DICT; v.u.j = j; break;
    case JSON_ARRAY: v.kind = JV_LIST; v.u.j = j; break;
    case JSON_STRING: v.kind = JV_STR; v.u.j = j; break;
    case JSON_INTEGER: v = jv_int((int64_t)json_integer_value(j)); break;
    case JSON_REAL: v = jv_float(json_real_value(j)); break;
    case JSON_TRUE: v = jv_bool(true); break;
    case JSON_FALSE: v = jv_bool(false); break;
    case JSON_NULL: v = jv_none(); break;
    }
    return v;
}

jv jv_from_json(json_t *j) {
    jv v = jv_peek(j);
    return jv_copy(&v);
}

jv jv_take_json(json_t *j) {
    if (!j) return jv_none();
    jv v = jv_from_json(j);
    json_decref(j);
    return v;
}

json_t *jv_to_json(const jv *v) {
    switch (v->kind) {
    case JV_BOOL: return json_boolean(v->u.b);
    case JV_INT: return json_integer((json_int_t)v->u.i);
    case JV_FLOAT: return isfinite(v->u.f) ? json_real(v->u.f) : json_null();
    case JV_STR:
        if (v->is_borrowed) return json_stringn_nocheck(jv_str_ptr(v), jv_str_len(v));
        return json_incref(v->u.j);
    case JV_LIST: case JV_DICT: return json_incref(v->u.j);
    case JV_NS: return json_deep_copy(v->u.j);
    default: return json_null();
    }
}

bool jv_truthy(const jv *v) {
    switch (v->kind) {
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0.0;
    case JV_STR: return json_string_length(v->u.j) > 0;
    case JV_LIST: return json_array_size(v->u.j) > 0;
    case JV_DICT: return json_object_size(v->u.j) > 0;
    case JV_NS: case JV_FUNC: case JV_LOOP: return true;
    default: return false;
    }
}

const char *jv_type_name(const jv *v) {
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int", "float", "str",
                                        "list", "dict", "Namespace", "function", "LoopContext"};
    return v->kind < PD_ARRAY_LEN(names) ? names[v->kind] : "object";
}

double jv_as_double(const jv *v) {
    if (v->kind == JV_INT) return (double)v->u.i;
    if (v->kind == JV_BOOL) return v->u.b ? 1.0 : 0.0;
    return v->u.f;
}

// ---- UTF-8 ----------------------------------------------------------------------------------------
uint32_t jj_utf8_next(const char *s, size_t len, size_t *i) {
    const unsigned char *p = (const unsigned char *)s;
    unsigned char c = p[*i];
    size_t n;
    uint32_t cp;
    if (c < 0x80) { (*i)++; return c; }
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else { (*i)++; return c; }
    if (*i + n >= len) { (*i)++; return c; }
    for (size_t k = 1; k <= n; k++) {
        if ((p[*i + k] & 0xC0) != 0x80) { (*i)++; return c; }
        cp = (cp << 6) | (p[*i + k] & 0x3F);
    }
    *i += n + 1;
    return cp;
}

size_t jj_utf8_count(const char *s, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) n++;
    return n;
}

size_t jj_utf8_offset(const char *s, size_t len, size_t n_cps) {
    size_t i = 0;
    while (n_cps > 0 && i < len) {
        jj_utf8_next(s, len, &i);
        n_cps--;
    }
    return i;
}

bool jj_utf8_put(jj_buf *b, uint32_t cp) {
    char t[4];
    size_t n;
    if (cp < 0x80) { t[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { t[0] = (char)(0xC0 | (cp >> 6)); t[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
    else if (cp < 0x10000) {
        t[0] = (char)(0xE0 | (cp >> 12)); t[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F)); n = 3;
    } else {
        t[0] = (char)(0xF0 | (cp >> 18)); t[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); t[3] = (char)(0x80 | (cp & 0x3F)); n = 4;
    }
    return jj_buf_put(b, t, n);
}

bool jj_utf8_valid(const char *s, size_t len) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned char c = p[i];
        if (c < 0x80) { i++; continue; }
        size_t n;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; min = 0x10000; }
        else return false;
        if (len - i <= n) return false;
        for (size_t k = 1; k <= n; k++) {
            if ((p[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += n + 1;
    }
    return true;
}

bool jj_is_space(uint32_t cp) {
    if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20);
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint32_t jj_utf8_prev(const char *s, size_t end, size_t *start) {
    size_t a = end - 1;
    while (a > 0 && end - a < 4 && ((unsigned char)s[a] & 0xC0) == 0x80) a--;
    size_t i = a;
    uint32_t cp = jj_utf8_next(s, end, &i);
    if (i != end) {  // not a whole sequence: the last byte stands alone
        *start = end - 1;
        return (unsigned char)s[end - 1];
    }
    *start = a;
    return cp;
}

size_t jj_rstrip_len(const char *s, size_t len) {
    size_t end = len;
    while (end > 0) {
        size_t start;
        if (!jj_is_space(jj_utf8_prev(s, end, &start))) break;
        end = start;
    }
    return end;
}

size_t jj_lstrip_off(const char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        size_t at = i;
        if (!jj_is_space(jj_utf8_next(s, len, &i))) return at;
    }
    return len;
}

// ---- float repr -----------------------------------------------------------------------------------
void jj_format_float(double f, char *buf) {
    if (isnan(f)) { strcpy(buf, "nan"); return; }
    if (isinf(f)) { strcpy(buf, f < 0 ? "-inf" : "inf"); return; }
    if (f == 0.0) { strcpy(buf, signbit(f) ? "-0.0" : "0.0"); return; }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    // tmp is [-]d[.ddd]e(+|-)XX: collect the significant digits and the decimal exponent.
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    char digits[24];
    int n_digits = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[n_digits++] = *p;
    while (n_digits > 1 && digits[n_digits - 1] == '0') n_digits--;
    int exp10 = atoi(p + 1);
    int decpt = exp10 + 1;  // value = 0.d1d2... * 10^decpt
    char *o = buf;
    if (neg) *o++ = '-';
    if (decpt > 16 || decpt < -3) {
        *o++ = digits[0];
        if (n_digits > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, (size_t)n_digits - 1);
            o += n_digits - 1;
        }
        sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
        return;
    }
    if (decpt <= 0) {
        *o++ = '0';
        *o++ = '.';
        for (int k = 0; k < -decpt; k++) *o++ = '0';
        memcpy(o, digits, (size_t)n_digits);
        o += n_digits;
    } else if (decpt >= n_digits) {
        memcpy(o, digits, (size_t)n_digits);
        o += n_digits;
        for (int k = n_digits; k < decpt; k++) *o++ = '0';
        *o++ = '.';
        *o++ = '0';
    } else {
        memcpy(o, digits, (size_t)decpt);
        o += decpt;
        *o++ = '.';
        memcpy(o, digits + decpt, (size_t)(n_digits - decpt));
        o += n_digits - decpt;
    }
    *o = 0;
}

// ---- str() and repr() -----------------------------------------------------------------------------
static bool depth_ok(jj_render *r, int depth) {
    if (depth <= JJ_MAX_VALUE_DEPTH) return true;
    return jj_fail(r, PD_ERR_INVALID, "line %d: value nested deeper than %d levels", r->line,
                   JJ_MAX_VALUE_DEPTH);
}

// Code points Python's str.isprintable() rejects, beyond the C0/C1 controls (an approximation of
// the Unicode tables: separators, format characters, private use).
static bool is_unprintable(uint32_t cp) {
    if (cp < 0x20 || (cp >= 0x7F && cp < 0xA0)) return true;
    return cp == 0xA0 || cp == 0xAD || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) ||
           (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x2064) ||
           (cp >= 0x2066 && cp <= 0x206F) || cp == 0x3000 || (cp >= 0xD800 && cp <= 0xF8FF) ||
           cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) || cp == 0xFFFE || cp == 0xFFFF ||
           cp >= 0xF0000 || cp == 0xE0001 || (cp >= 0xE0020 && cp <= 0xE007F);
}

static bool write_str_repr(jj_buf *b, const char *s, size_t len) {
    bool has_sq = memchr(s, '\'', len) != NULL, has_dq = memchr(s, '"', len) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    if (!jj_buf_putc(b, q)) return false;
    size_t i = 0;
    while (i < len) {
        size_t at = i;
        uint32_t cp = jj_utf8_next(s, len, &i);
        bool ok;
        if (cp == (uint32_t)q || cp == '\\') {
            char t[2] = {'\\', (char)cp};
            ok = jj_buf_put(b, t, 2);
        } else if (cp == '\n') ok = jj_buf_put(b, "\\n", 2);
        else if (cp == '\r') ok = jj_buf_put(b, "\\r", 2);
        else if (cp == '\t') ok = jj_buf_put(b, "\\t", 2);
        else if (is_unprintable(cp)) {
            if (cp < 0x100) ok = jj_buf_printf(b, "\\x%02x", cp);
            else if (cp < 0x10000) ok = jj_buf_printf(b, "\\u%04x", cp);
            else ok = jj_buf_printf(b, "\\U%08x", cp);
        } else ok = jj_buf_put(b, s + at, i - at);
        if (!ok) return false;
    }
    return jj_buf_putc(b, q);
}

static bool write_scalar(jj_buf *b, const jv *v) {
    char tmp[40];
    switch (v->kind) {
    case JV_NONE: return jj_buf_put(b, "None", 4);
    case JV_BOOL: return v->u.b ? jj_buf_put(b, "True", 4) : jj_buf_put(b, "False", 5);
    case JV_INT: return jj_buf_printf(b, "%lld", (long long)v->u.i);
    case JV_FLOAT: jj_format_float(v->u.f, tmp); return jj_buf_puts(b, tmp);
    default: return true;
    }
}

static bool buf_ok(jj_render *r, jj_buf *b, bool ok) { return ok ? true : jj_fail_buf(r, b); }

bool jj_write_repr(jj_render *r, jj_buf *b, const jv *v, int depth) {
    if (!depth_ok(r, depth)) return false;
    switch (v->kind) {
    case JV_UNDEF: return buf_ok(r, b, jj_buf_puts(b, "Undefined"));
    case JV_STR: return buf_ok(r, b, write_str_repr(b, jv_str_ptr(v), jv_str_len(v)));
    case JV_LIST: {
        if (!jj_buf_putc(b, '[')) return jj_fail_buf(r, b);
        for (size_t k = 0; k < json_array_size(v->u.j); k++) {
            jv e = jv_peek(json_array_get(v->u.j, k));
            if (k && !jj_buf_put(b, ", ", 2)) return jj_fail_buf(r, b);
            if (!jj_write_repr(r, b, &e, depth + 1)) return false;
        }
        return buf_ok(r, b, jj_buf_putc(b, ']'));
    }
    case JV_DICT: case JV_NS: {
        if (v->kind == JV_NS && !jj_buf_puts(b, "<Namespace ")) return jj_fail_buf(r, b);
        if (!jj_buf_putc(b, '{')) return jj_fail_buf(r, b);
        const char *key;
        json_t *val;
        size_t k = 0;
        json_object_foreach(v->u.j, key, val) {
            jv e = jv_peek(val);
            if (k++ && !jj_buf_put(b, ", ", 2)) return jj_fail_buf(r, b);
            if (!write_str_repr(b, key, strlen(key)) || !jj_buf_put(b, ": ", 2))
                return jj_fail_buf(r, b);
            if (!jj_write_repr(r, b, &e, depth + 1)) return false;
        }
        if (!jj_buf_putc(b, '}')) return jj_fail_buf(r, b);
        return buf_ok(r, b, v->kind == JV_NS ? jj_buf_putc(b, '>') : true);
    }
    case JV_FUNC: return buf_ok(r, b, jj_buf_puts(b, "<function>"));
    case JV_LOOP: {
        const jj_loop *l = (const jj_loop *)v->u.o;
        return buf_ok(r, b, jj_buf_printf(b, "<LoopContext %zu/%zu>", l->index0 + 1, l->length));
    }
    default: return buf_ok(r, b, write_scalar(b, v));
    }
}

bool jj_write_str(jj_render *r, jj_buf *b, const jv *v) {
    if (v->kind == JV_UNDEF) return true;
    if (v->kind == JV_STR) return buf_ok(r, b, jj_buf_put(b, jv_str_ptr(v), jv_str_len(v)));
    return jj_write_repr(r, b, v, 0);
}

// ---- json.dumps -----------------------------------------------------------------------------------
static bool json_write_string(jj_buf *b, const char *s, size_t len, bool ensure_ascii) {
    if (!jj_buf_putc(b, '"')) return false;
    size_t run = 0, i = 0;
    while (i < len) {
        size_t at = i;
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[16];
        if (c >= 0x80) {
            uint32_t cp = jj_utf8_next(s, len, &i);
            if (!ensure_ascii) continue;
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(tmp, sizeof tmp, "\\u%04x", cp);
            }
            esc = tmp;
        } else {
            i++;
            if (c == '"') esc = "\\\"";
            else if (c == '\\') esc = "\\\\";
            else if (c == '\n') esc = "\\n";
            else if (c == '\r') esc = "\\r";
            else if (c == '\t') esc = "\\t";
            else if (c == '\b') esc = "\\b";
            else if (c == '\f') esc = "\\f";
            else if (c < 0x20 || (c == 0x7f && ensure_ascii)) {
                snprintf(tmp, sizeof tmp, "\\u%04x", c);
                esc = tmp;
            }
        }
        if (!esc) continue;
        if (!jj_buf_put(b, s + run, at - run) || !jj_buf_puts(b, esc)) return false;
        run = i;
    }
    return jj_buf_put(b, s + run, len - run) && jj_buf_putc(b, '"');
}

static bool json_newline(jj_buf *b, const jj_json_fmt *fmt, int level) {
    if (!fmt->indent) return true;
    if (!jj_buf_putc(b, '\n')) return false;
    for (int k = 0; k < level; k++)
        if (!jj_buf_put(b, fmt->indent, fmt->indent_len)) return false;
    return true;
}

static int cmp_keys(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool json_write_value(jj_render *r, jj_buf *b, const jv *v, const jj_json_fmt *fmt, int level);

static bool json_write_object(jj_render *r, jj_buf *b, json_t *obj, const jj_json_fmt *fmt,
                              int level) {
    size_t n = json_object_size(obj);
    if (n == 0) return buf_ok(r, b, jj_buf_put(b, "{}", 2));
    const char **keys = pd_malloc(n * sizeof *keys);
    if (!keys) return jj_fail_nomem(r);
    size_t k = 0;
    const char *key;
    json_t *val;
    json_object_foreach(obj, key, val) keys[k++] = key;
    if (fmt->sort_keys) qsort(keys, n, sizeof *keys, cmp_keys);
    bool ok = jj_buf_putc(b, '{') && json_newline(b, fmt, level + 1);
    for (k = 0; ok && k < n; k++) {
        if (k) ok = jj_buf_puts(b, fmt->item_sep) && json_newline(b, fmt, level + 1);
        ok = ok && json_write_string(b, keys[k], strlen(keys[k]), fmt->ensure_ascii) && jj_buf_puts(b, fmt->key_sep);
        if (!ok) break;
        jv e = jv_peek(json_object_get(obj, keys[k]));
        if (!json_write_value(r, b, &e, fmt, level + 1)) {
            pd_free(keys);
            return false;
        }
    }
    pd_free(keys);
    ok = ok && json_newline(b, fmt, level) && jj_buf_putc(b, '}');
    return buf_ok(r, b, ok);
}

static bool json_write_value(jj_render *r, jj_buf *b, const jv *v, const jj_json_fmt *fmt, int level) {
    if (!depth_ok(r, level)) return false;
    char tmp[40];
    switch (v->kind) {
    case JV_NONE: return buf_ok(r, b, jj_buf_put(b, "null", 4));
    case JV_BOOL: return buf_ok(r, b, jj_buf_puts(b, v->u.b ? "true" : "false"));
    case JV_INT: return buf_ok(r, b, jj_buf_printf(b, "%lld", (long long)v->u.i));
    case JV_FLOAT:
        if (isnan(v->u.f)) strcpy(tmp, "NaN");
        else if (isinf(v->u.f)) strcpy(tmp, v->u.f < 0 ? "-Infinity" : "Infinity");
        else jj_format_float(v->u.f, tmp);
        return buf_ok(r, b, jj_buf_puts(b, tmp));
    case JV_STR: return buf_ok(r, b, json_write_string(b, jv_str_ptr(v), jv_str_len(v), fmt->ensure_ascii));
    case JV_LIST: {
        size_t n = json_array_size(v->u.j);
        if (n == 0) return buf_ok(r, b, jj_buf_put(b, "[]", 2));
        if (!jj_buf_putc(b, '[') || !json_newline(b, fmt, level + 1)) return jj_fail_buf(r, b);
        for (size_t k = 0; k < n; k++) {
            if (k && (!jj_buf_puts(b, fmt->item_sep) || !json_newline(b, fmt, level + 1)))
                return jj_fail_buf(r, b);
            jv e = jv_peek(json_array_get(v->u.j, k));
            if (!json_write_value(r, b, &e, fmt, level + 1)) return false;
        }
        return buf_ok(r, b, json_newline(b, fmt, level) && jj_buf_putc(b, ']'));
    }
    case JV_DICT: return json_write_object(r, b, v->u.j, fmt, level);
    default:
        return jj_fail(r, PD_ERR_INVALID, "line %d: Object of type %s is not JSON serializable",
                       r->line, jv_type_name(v));
    }
}

bool jj_write_json(jj_render *r, jj_buf *b, const jv *v, const jj_json_fmt *fmt) {
    return json_write_value(r, b, v, fmt, 0);
}

// ---- equality and ordering ------------------------------------------------------------------------
static bool list_equal(json_t *a, json_t *b, int depth) {
    size_t n = json_array_size(a);
    if (n != json_array_size(b)) return false;
    for (size_t k = 0; k < n; k++) {
        jv x = jv_peek(json_array_get(a, k)), y = jv_peek(json_array_get(b, k));
        if (!jj_equal(&x, &y, depth + 1)) return false;
    }
    return true;
}

static bool dict_equal(json_t *a, json_t *b, int depth) {
    if (json_object_size(a) != json_object_size(b)) return false;
    const char *key;
    size_t key_len;
    json_t *val;
    json_object_keylen_foreach(a, key, key_len, val) {
        json_t *other = json_object_getn(b, key, key_len);
        if (!other) return false;
        jv x = jv_peek(val), y = jv_peek(other);
        if (!jj_equal(&x, &y, depth + 1)) return false;
    }
    return true;
}

bool jj_equal(const jv *a, const jv *b, int depth) {
    if (depth > JJ_MAX_VALUE_DEPTH) return false;
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT) {
            int64_t x = a->kind == JV_BOOL ? a->u.b : a->u.i, y = b->kind == JV_BOOL ? b->u.b : b->u.i;
            return x == y;
        }
        return jv_as_double(a) == jv_as_double(b);
    }
    if (a->kind != b->kind) return false;
    switch (a->kind) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR:
        return jv_str_len(a) == jv_str_len(b) && !memcmp(jv_str_ptr(a), jv_str_ptr(b), jv_str_len(a));
    case JV_LIST: return a->u.j == b->u.j || list_equal(a->u.j, b->u.j, depth);
    case JV_DICT: return a->u.j == b->u.j || dict_equal(a->u.j, b->u.j, depth);
    case JV_NS: return a->u.j == b->u.j;
    default: return a->u.o == b->u.o;
    }
}

static bool list_compare(jj_render *r, json_t *a, json_t *b, int *cmp) {
    size_t na = json_array_size(a), nb = json_array_size(b);
    for (size_t k = 0; k < na && k < nb; k++) {
        jv x = jv_peek(json_array_get(a, k)), y = jv_peek(json_array_get(b, k));
        if (jj_equal(&x, &y, 0)) continue;
        return jj_compare(r, &x, &y, cmp);
    }
    *cmp = na < nb ? -1 : na > nb ? 1 : 0;
    return true;
}

bool jj_compare(jj_render *r, const jv *a, const jv *b, int *cmp) {
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT) {
            int64_t x = a->kind == JV_BOOL ? a->u.b : a->u.i, y = b->kind == JV_BOOL ? b->u.b : b->u.i;
            *cmp = x < y ? -1 : x > y;
        } else {
            double x = jv_as_double(a), y = jv_as_double(b);
            *cmp = x < y ? -1 : x > y;
        }
        return true;
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t la = jv_str_len(a), lb = jv_str_len(b);
        int c = memcmp(jv_str_ptr(a), jv_str_ptr(b), la < lb ? la : lb);
        *cmp = c < 0 ? -1 : c > 0 ? 1 : la < lb ? -1 : la > lb;
        return true;
    }
    if (a->kind == JV_LIST && b->kind == JV_LIST) return list_compare(r, a->u.j, b->u.j, cmp);
    return jj_fail(r, PD_ERR_INVALID, "line %d: '<' not supported between instances of '%s' and '%s'",
                   r->line, jv_type_name(a), jv_type_name(b));
}

bool jj_fold_case(jj_render *r, const jv *v, jv *out) {
    if (v->kind != JV_STR) {
        *out = jv_copy(v);
        return true;
    }
    return jj_case(r, v, 'l', out);
}
