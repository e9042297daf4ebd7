// jinja_method.c — Python methods templates call on values (message.content.strip(),
// tool.items(), loop.cycle(...)), the string helpers filters share with them, and printf-style
// `%` formatting.
//
// str: strip lstrip rstrip split rsplit splitlines startswith endswith upper lower title
//      capitalize replace find rfind count join format isdigit isalpha isalnum isspace islower
//      isupper; dict: get items keys values; loop: cycle.
// Mutating methods (list.append, dict.update, ...) are absent on purpose: transformers renders in
// jinja2's ImmutableSandboxedEnvironment, where calling them is a SecurityError.
//
// Case mapping uses simple one-to-one tables for the common alphabets (see jinja.h). Code point
// semantics are kept everywhere: find() returns code point offsets, strip() strips Unicode
// whitespace from both ends without scanning the middle.
#include <stdio.h>
#include <string.h>

#include "tok/jinja_impl.h"

enum {
    M_STRIP = 0, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_SPLITLINES, M_STARTSWITH, M_ENDSWITH,
    M_UPPER, M_LOWER, M_TITLE, M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_COUNT, M_JOIN, M_FORMAT,
    M_ISDIGIT, M_ISALPHA, M_ISALNUM, M_ISSPACE, M_ISLOWER, M_ISUPPER,
    M_N_STR,
    M_GET = M_N_STR, M_ITEMS, M_KEYS, M_VALUES,
    M_CYCLE,
    M_N,
};

static const char *const method_names[M_N] = {
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "upper",
    "lower", "title", "capitalize", "replace", "find", "rfind", "count", "join", "format", "isdigit",
    "isalpha", "isalnum", "isspace", "islower", "isupper",
    "get", "items", "keys", "values",
    "cycle",
};

int jj_method_lookup(const jv *self, const char *name) {
    int lo, hi;
    if (self->kind == JV_STR) lo = 0, hi = M_N_STR;
    else if (self->kind == JV_DICT) lo = M_GET, hi = M_CYCLE;
    else if (self->kind == JV_LOOP) lo = M_CYCLE, hi = M_N;
    else return -1;
    for (int k = lo; k < hi; k++)
        if (!strcmp(method_names[k], name)) return k;
    return -1;
}

const char *jj_method_name(int id) { return id >= 0 && id < M_N ? method_names[id] : "?"; }

// ---- shared string helpers ------------------------------------------------------------------------
bool jj_to_str(jj_render *r, const jv *v, jv *out) {
    if (v->kind == JV_STR) {
        *out = jv_copy(v);
        return true;
    }
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    if (!jj_write_str(r, &b, v)) {
        jj_buf_fini(&b);
        return false;
    }
    return jj_str_from_buf(r, &b, out);
}

static bool cp_in(uint32_t cp, const jv *chars) {
    const char *s = jv_str_ptr(chars);
    size_t n = jv_str_len(chars), i = 0;
    while (i < n)
        if (jj_utf8_next(s, n, &i) == cp) return true;
    return false;
}

bool jj_strip(jj_render *r, const jv *sv, const jv *chars, char which, jv *out) {
    if (chars && chars->kind == JV_NONE) chars = NULL;
    if (chars && chars->kind != JV_STR)
        return jj_fail(r, PD_ERR_INVALID, "line %d: strip arg must be None or str", r->line);
    const char *s = jv_str_ptr(sv);
    size_t n = jv_str_len(sv), start = 0, end = n;
    if (which != 'r') {
        while (start < n) {
            size_t i = start;
            uint32_t cp = jj_utf8_next(s, n, &i);
            if (chars ? !cp_in(cp, chars) : !jj_is_space(cp)) break;
            start = i;
        }
    }
    if (which != 'l') {
        while (end > start) {
            size_t at;
            uint32_t cp = jj_utf8_prev(s, end, &at);
            if (chars ? !cp_in(cp, chars) : !jj_is_space(cp)) break;
            end = at;
        }
    }
    return jj_str_new(r, s + start, end - start, out);
}

bool jj_replace(jj_render *r, const jv *sv, const jv *old, const jv *repl, int64_t count, jv *out) {
    const char *s = jv_str_ptr(sv), *o = jv_str_ptr(old), *p = jv_str_ptr(repl);
    size_t n = jv_str_len(sv), on = jv_str_len(old), pn = jv_str_len(repl);
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    size_t i = 0;
    int64_t done = 0;
    if (on == 0) {
        // Python inserts the replacement before every code point and at the end.
        while (count < 0 || done < count) {
            jj_buf_put(&b, p, pn);
            done++;
            if (i >= n) break;
            size_t at = i;
            jj_utf8_next(s, n, &i);
            jj_buf_put(&b, s + at, i - at);
        }
        jj_buf_put(&b, s + i, n - i);
    } else {
        while (i < n) {
            const char *hit = (count < 0 || done < count) ? memmem(s + i, n - i, o, on) : NULL;
            if (!hit) break;
            jj_buf_put(&b, s + i, (size_t)(hit - (s + i)));
            jj_buf_put(&b, p, pn);
            i = (size_t)(hit - s) + on;
            done++;
        }
        jj_buf_put(&b, s + i, n - i);
    }
    return jj_str_from_buf(r, &b, out);
}

// Simple (one-to-one) case mappings for Latin-1, Latin Extended-A, Greek, Cyrillic and fullwidth
// Latin; everything else maps to itself. Python's special cases (final sigma, dotted I) are not
// reproduced; "ß".upper() == "SS" is (in jj_case).
static uint32_t cp_upper(uint32_t c) {
    if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
    if (c == 0xFF) return 0x178;
    if (c == 0xB5) return 0x39C;
    if ((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) return c & ~1u;
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c & 1u) ? c : c - 1;
    if (c == 0x17F) return 'S';
    if (c >= 0x3B1 && c <= 0x3C9) return c == 0x3C2 ? 0x3A3 : c - 32;
    if (c == 0x3AC) return 0x386;
    if (c >= 0x3AD && c <= 0x3AF) return c - 37;
    if (c == 0x3CC) return 0x38C;
    if (c == 0x3CD || c == 0x3CE) return c - 63;
    if (c >= 0x430 && c <= 0x44F) return c - 32;
    if (c >= 0x450 && c <= 0x45F) return c - 80;
    if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F)) return c & ~1u;
    if (c >= 0xFF41 && c <= 0xFF5A) return c - 32;
    return c;
}

static uint32_t cp_lower(uint32_t c) {
    if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
    if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
    if (c == 0x178) return 0xFF;
    if ((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) return c | 1u;
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c & 1u) ? c + 1 : c;
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
    if (c == 0x386) return 0x3AC;
    if (c >= 0x388 && c <= 0x38A) return c + 37;
    if (c == 0x38C) return 0x3CC;
    if (c == 0x38E || c == 0x38F) return c + 63;
    if (c >= 0x410 && c <= 0x42F) return c + 32;
    if (c >= 0x400 && c <= 0x40F) return c + 80;
    if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F)) return c | 1u;
    if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
    return c;
}

static bool cp_is_cased(uint32_t c) { return cp_upper(c) != c || cp_lower(c) != c || c == 0xDF; }

static bool put_upper(jj_buf *b, uint32_t cp) {
    if (cp == 0xDF) return jj_buf_put(b, "SS", 2);
    return jj_utf8_put(b, cp_upper(cp));
}

static bool is_title_sep(uint32_t cp) {
    return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || jj_is_space(cp);
}

bool jj_case(jj_render *r, const jv *sv, char mode, jv *out) {
    jv str;
    if (!jj_to_str(r, sv, &str)) return false;
    const char *s = jv_str_ptr(&str);
    size_t n = jv_str_len(&str), i = 0;
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    bool word_start = true, first = true;
    while (i < n) {
        size_t at = i;
        uint32_t cp = jj_utf8_next(s, n, &i);
        bool up;
        switch (mode) {
        case 'u': up = true; break;
        case 'l': up = false; break;
        case 'c': up = first; break;
        case 't':  // Python str.title(): a cased letter after an uncased character starts a word
            up = word_start;
            word_start = !cp_is_cased(cp);
            break;
        default:  // jinja2's title filter: words start after -, whitespace, (, {, [, <
            if (is_title_sep(cp)) {
                word_start = true;
                jj_buf_put(&b, s + at, i - at);
                continue;
            }
            up = word_start;
            word_start = false;
            break;
        }
        first = false;
        if (cp < 0x80 || cp_is_cased(cp)) {
            if (up) put_upper(&b, cp);
            else jj_utf8_put(&b, cp_lower(cp));
        } else {
            jj_buf_put(&b, s + at, i - at);
        }
    }
    jv_drop(&str);
    return jj_str_from_buf(r, &b, out);
}

// ---- % formatting ---------------------------------------------------------------------------------
static bool format_one(jj_render *r, jj_buf *b, char conv, int prec, const jv *v) {
    char tmp[64];
    if (conv == 's') return jj_write_str(r, b, v);
    if (conv == 'r') return jj_write_repr(r, b, v, 0);
    if (!jv_is_num(v))
        return jj_fail(r, PD_ERR_INVALID, "line %d: %%%c format: a real number is required, not %s", r->line,
                       conv, jv_type_name(v));
    if (conv == 'd' || conv == 'i') {
        long long x = v->kind == JV_FLOAT ? (long long)v->u.f : (long long)(v->kind == JV_BOOL ? v->u.b : v->u.i);
        snprintf(tmp, sizeof tmp, "%lld", x);
    } else if (conv == 'x' || conv == 'X') {
        if (v->kind == JV_FLOAT)
            return jj_fail(r, PD_ERR_INVALID, "line %d: %%x format: an integer is required", r->line);
        long long x = v->kind == JV_BOOL ? v->u.b : v->u.i;
        snprintf(tmp, sizeof tmp, conv == 'x' ? "%s%llx" : "%s%llX", x < 0 ? "-" : "", x < 0 ? -(unsigned long long)x : (unsigned long long)x);
    } else {
        snprintf(tmp, sizeof tmp, conv == 'e' ? "%.*e" : "%.*f", prec < 0 ? 6 : prec > 30 ? 30 : prec, jv_as_double(v));
    }
    return jj_buf_puts(b, tmp) ? true : jj_fail_buf(r, b);
}

bool jj_percent_format(jj_render *r, const jv *fmt, const jv *args, jv *out) {
    const char *s = jv_str_ptr(fmt);
    size_t n = jv_str_len(fmt), used = 0;
    bool is_tuple = args->kind == JV_LIST;
    size_t n_args = is_tuple ? json_array_size(args->u.j) : 1;
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') {
            if (!jj_buf_putc(&b, s[i])) break;
            continue;
        }
        i++;
        int prec = -1;
        if (i < n && s[i] == '.') {
            prec = 0;
            for (i++; i < n && s[i] >= '0' && s[i] <= '9'; i++) prec = prec * 10 + (s[i] - '0');
        }
        char conv = i < n ? s[i] : 0;
        if (conv == '%') {
            jj_buf_putc(&b, '%');
            continue;
        }
        if (!conv || !strchr("srdixXfe", conv)) {
            jj_buf_fini(&b);
            return jj_fail(r, PD_ERR_INVALID, "line %d: unsupported format character in %% format", r->line);
        }
        if (used >= n_args) {
            jj_buf_fini(&b);
            return jj_fail(r, PD_ERR_INVALID, "line %d: not enough arguments for format string", r->line);
        }
        jv v = is_tuple ? jv_from_json(json_array_get(args->u.j, used)) : jv_copy(args);
        used++;
        bool ok = format_one(r, &b, conv, prec, &v);
        jv_drop(&v);
        if (!ok) {
            jj_buf_fini(&b);
            return false;
        }
    }
    if (used < n_args && r->status == PD_OK && !b.is_over) {
        jj_buf_fini(&b);
        return jj_fail(r, PD_ERR_INVALID, "line %d: not all arguments converted during string formatting", r->line);
    }
    return jj_str_from_buf(r, &b, out);
}

// ---- str methods ----------------------------------------------------------------------------------
static bool want_str(jj_render *r, const jv *v, const char *what) {
    if (v && v->kind == JV_STR) return true;
    return jj_fail(r, PD_ERR_INVALID, "line %d: %s expects a string argument", r->line, what);
}

typedef struct span {
    size_t start, end;
} span;

static bool span_push(span **v, size_t *n, size_t *cap, size_t start, size_t end) {
    if (PD_ARRAY_RESERVE(*v, *cap, *n + 1) != PD_OK) return false;
    (*v)[(*n)++] = (span){start, end};
    return true;
}

// Separator occurrences (non-overlapping; scanned from the right for rsplit), in string order.
static bool find_seps(const char *s, size_t n, const char *p, size_t pn, bool from_right, span **v,
                      size_t *nv) {
    size_t cap = 0;
    *v = NULL;
    *nv = 0;
    if (!from_right) {
        for (size_t i = 0; i + pn <= n;) {
            const char *h = memmem(s + i, n - i, p, pn);
            if (!h) break;
            if (!span_push(v, nv, &cap, (size_t)(h - s), (size_t)(h - s) + pn)) return false;
            i = (size_t)(h - s) + pn;
        }
        return true;
    }
    size_t end = n;
    while (end >= pn) {
        size_t at = end - pn;
        if (memcmp(s + at, p, pn)) {
            end--;
            continue;
        }
        if (!span_push(v, nv, &cap, at, at + pn)) return false;
        end = at;
    }
    for (size_t k = 0; k < *nv / 2; k++) {
        span t = (*v)[k];
        (*v)[k] = (*v)[*nv - 1 - k];
        (*v)[*nv - 1 - k] = t;
    }
    return true;
}

// Maximal runs of non-whitespace.
static bool find_words(const char *s, size_t n, span **v, size_t *nv) {
    size_t cap = 0, i = 0;
    *v = NULL;
    *nv = 0;
    while (i < n) {
        size_t at = i;
        if (jj_is_space(jj_utf8_next(s, n, &i))) continue;
        size_t end = i;
        while (i < n) {
            size_t at2 = i;
            if (jj_is_space(jj_utf8_next(s, n, &i))) {
                i = at2;
                break;
            }
            end = i;
        }
        if (!span_push(v, nv, &cap, at, end)) return false;
    }
    return true;
}

static bool split(jj_render *r, const jv *self, const jj_args *a, bool from_right, jv *out) {
    const jv *sep = jj_arg(a, 0, "sep"), *maxv = jj_arg(a, 1, "maxsplit");
    int64_t maxsplit = maxv && maxv->kind == JV_INT ? maxv->u.i : -1;
    if (sep && sep->kind == JV_NONE) sep = NULL;
    if (sep && !want_str(r, sep, "split")) return false;
    if (sep && jv_str_len(sep) == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: empty separator", r->line);
    const char *s = jv_str_ptr(self);
    size_t n = jv_str_len(self), nv;
    span *v;
    bool ok = sep ? find_seps(s, n, jv_str_ptr(sep), jv_str_len(sep), from_right, &v, &nv)
                  : find_words(s, n, &v, &nv);
    json_t *arr = ok ? json_array() : NULL;
    if (!arr) {
        pd_free(v);
        return jj_fail_nomem(r);
    }
    size_t m = maxsplit < 0 ? (size_t)-1 : (size_t)maxsplit;
    if (sep) {
        // Cuts used: the first m (split) or the last m (rsplit).
        size_t first = (from_right && m < nv) ? nv - m : 0, last = (!from_right && m < nv) ? m : nv;
        size_t start = 0;
        for (size_t k = first; ok && k < last; k++) {
            ok = !json_array_append_new(arr, json_stringn_nocheck(s + start, v[k].start - start));
            start = v[k].end;
        }
        ok = ok && !json_array_append_new(arr, json_stringn_nocheck(s + start, n - start));
    } else if (m >= nv) {
        for (size_t k = 0; ok && k < nv; k++)
            ok = !json_array_append_new(arr, json_stringn_nocheck(s + v[k].start, v[k].end - v[k].start));
    } else if (!from_right) {
        for (size_t k = 0; ok && k < m; k++)
            ok = !json_array_append_new(arr, json_stringn_nocheck(s + v[k].start, v[k].end - v[k].start));
        ok = ok && !json_array_append_new(arr, json_stringn_nocheck(s + v[m].start, n - v[m].start));
    } else {
        size_t keep = nv - m;  // words merged into the leading remainder
        ok = !json_array_append_new(arr, json_stringn_nocheck(s, v[keep - 1].end));
        for (size_t k = keep; ok && k < nv; k++)
            ok = !json_array_append_new(arr, json_stringn_nocheck(s + v[k].start, v[k].end - v[k].start));
    }
    pd_free(v);
    if (!ok) {
        json_decref(arr);
        return jj_fail_nomem(r);
    }
    if (!jj_step(r, json_array_size(arr))) {
        json_decref(arr);
        return false;
    }
    *out = jv_take_json(arr);
    return true;
}

static bool splitlines(jj_render *r, const jv *self, jv *out) {
    const char *s = jv_str_ptr(self);
    size_t n = jv_str_len(self), i = 0, start = 0;
    json_t *arr = json_array();
    if (!arr) return jj_fail_nomem(r);
    while (i < n) {
        size_t at = i;
        uint32_t cp = jj_utf8_next(s, n, &i);
        bool brk = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || (cp >= 0x1C && cp <= 0x1E) ||
                   cp == 0x85 || cp == 0x2028 || cp == 0x2029;
        if (!brk) continue;
        if (cp == '\r' && i < n && s[i] == '\n') i++;
        if (json_array_append_new(arr, json_stringn_nocheck(s + start, at - start))) {
            json_decref(arr);
            return jj_fail_nomem(r);
        }
        start = i;
    }
    if (start < n && json_array_append_new(arr, json_stringn_nocheck(s + start, n - start))) {
        json_decref(arr);
        return jj_fail_nomem(r);
    }
    *out = jv_take_json(arr);
    return true;
}

static bool affix(jj_render *r, const jv *self, const jv *arg, bool at_end, jv *out) {
    const char *s = jv_str_ptr(self);
    size_t n = jv_str_len(self);
    if (!arg) return jj_fail(r, PD_ERR_INVALID, "line %d: %s takes at least 1 argument", r->line,
                             at_end ? "endswith" : "startswith");
    size_t count = arg->kind == JV_LIST ? json_array_size(arg->u.j) : 1;
    for (size_t k = 0; k < count; k++) {
        jv p = arg->kind == JV_LIST ? jv_from_json(json_array_get(arg->u.j, k)) : jv_copy(arg);
        bool is_str = p.kind == JV_STR;
        bool hit = is_str && jv_str_len(&p) <= n &&
                   !memcmp(at_end ? s + n - jv_str_len(&p) : s, jv_str_ptr(&p), jv_str_len(&p));
        jv_drop(&p);
        if (!is_str) return jj_fail(r, PD_ERR_INVALID, "line %d: %s arg must be str or a tuple of str",
                                    r->line, at_end ? "endswith" : "startswith");
        if (hit) {
            *out = jv_bool(true);
            return true;
        }
    }
    *out = jv_bool(false);
    return true;
}

static bool find(jj_render *r, const jv *self, const jv *sub, int id, jv *out) {
    if (!want_str(r, sub, jj_method_name(id))) return false;
    const char *s = jv_str_ptr(self), *p = jv_str_ptr(sub);
    size_t n = jv_str_len(self), pn = jv_str_len(sub);
    int64_t count = 0, found = -1;
    size_t i = 0;
    if (pn == 0) {
        size_t cps = jj_utf8_count(s, n);
        *out = jv_int(id == M_COUNT ? (int64_t)cps + 1 : id == M_FIND ? 0 : (int64_t)cps);
        return true;
    }
    for (const char *h; i + pn <= n && (h = memmem(s + i, n - i, p, pn)) != NULL;) {
        size_t at = (size_t)(h - s);
        count++;
        found = (int64_t)jj_utf8_count(s, at);
        if (id == M_FIND) break;
        i = id == M_COUNT ? at + pn : at + 1;
    }
    *out = jv_int(id == M_COUNT ? count : found);
    return true;
}

static bool join(jj_render *r, const jv *self, const jv *items, jv *out) {
    json_t *list;
    if (!items) return jj_fail(r, PD_ERR_INVALID, "line %d: join takes exactly one argument", r->line);
    if (!jj_iter_list(r, items, &list)) return false;
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    bool ok = true;
    for (size_t k = 0; ok && k < json_array_size(list); k++) {
        json_t *e = json_array_get(list, k);
        if (!json_is_string(e)) {
            jv bad = jv_from_json(e);
            ok = jj_fail(r, PD_ERR_INVALID, "line %d: sequence item %zu: expected str instance, %s found",
                         r->line, k, jv_type_name(&bad));
            jv_drop(&bad);
            break;
        }
        if (k) jj_buf_put(&b, jv_str_ptr(self), jv_str_len(self));
        jj_buf_put(&b, json_string_value(e), json_string_length(e));
    }
    json_decref(list);
    if (!ok) {
        jj_buf_fini(&b);
        return false;
    }
    return jj_str_from_buf(r, &b, out);
}

// "{} {0} {name}".format(...): fields with optional !r/!s conversion, no format specs.
static bool str_format(jj_render *r, const jv *self, const jj_args *a, jv *out) {
    const char *s = jv_str_ptr(self);
    size_t n = jv_str_len(self), auto_idx = 0;
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if ((c == '{' || c == '}') && i + 1 < n && s[i + 1] == c) {
            jj_buf_putc(&b, c);
            i++;
            continue;
        }
        if (c == '}') goto bad;
        if (c != '{') {
            jj_buf_putc(&b, c);
            continue;
        }
        size_t close = i + 1;
        while (close < n && s[close] != '}') close++;
        if (close >= n) goto bad;
        char field[64];
        size_t fl = close - i - 1;
        if (fl >= sizeof field) goto bad;
        memcpy(field, s + i + 1, fl);
        field[fl] = 0;
        char conv = 's';
        char *bang = strchr(field, '!');
        if (bang) {
            conv = bang[1];
            *bang = 0;
        }
        if (strchr(field, ':') || (conv != 's' && conv != 'r')) goto bad;
        const jv *v;
        if (!field[0]) v = jj_arg(a, (int)auto_idx++, NULL);
        else if (field[0] >= '0' && field[0] <= '9') v = jj_arg(a, atoi(field), NULL);
        else v = jj_arg(a, -1, field);
        if (!v) {
            jj_buf_fini(&b);
            return jj_fail(r, PD_ERR_INVALID, "line %d: format field '%s' has no argument", r->line, field);
        }
        if (!(conv == 'r' ? jj_write_repr(r, &b, v, 0) : jj_write_str(r, &b, v))) {
            jj_buf_fini(&b);
            return false;
        }
        i = close;
    }
    return jj_str_from_buf(r, &b, out);
bad:
    jj_buf_fini(&b);
    return jj_fail(r, PD_ERR_INVALID, "line %d: unsupported str.format() string", r->line);
}

static bool str_predicate(const jv *self, int id) {
    const char *s = jv_str_ptr(self);
    size_t n = jv_str_len(self), i = 0;
    bool any_cased = false;
    if (n == 0) return false;
    while (i < n) {
        uint32_t cp = jj_utf8_next(s, n, &i);
        bool digit = cp >= '0' && cp <= '9', up = cp_lower(cp) != cp, low = cp_upper(cp) != cp || cp == 0xDF;
        bool alpha = up || low || (cp >= 0x80 && !jj_is_space(cp));
        switch (id) {
        case M_ISDIGIT: if (!digit) return false; break;
        case M_ISALPHA: if (!alpha) return false; break;
        case M_ISALNUM: if (!alpha && !digit) return false; break;
        case M_ISSPACE: if (!jj_is_space(cp)) return false; break;
        case M_ISLOWER: if (up) return false; any_cased = any_cased || low; break;
        default: if (low) return false; any_cased = any_cased || up; break;
        }
    }
    return (id == M_ISLOWER || id == M_ISUPPER) ? any_cased : true;
}

static bool str_method(jj_render *r, int id, const jv *self, const jj_args *a, jv *out) {
    const jv *a0 = jj_arg(a, 0, NULL), *a1 = jj_arg(a, 1, NULL), *a2 = jj_arg(a, 2, NULL);
    switch (id) {
    case M_STRIP: return jj_strip(r, self, a0, 'b', out);
    case M_LSTRIP: return jj_strip(r, self, a0, 'l', out);
    case M_RSTRIP: return jj_strip(r, self, a0, 'r', out);
    case M_SPLIT: return split(r, self, a, false, out);
    case M_RSPLIT: return split(r, self, a, true, out);
    case M_SPLITLINES: return splitlines(r, self, out);
    case M_STARTSWITH: return affix(r, self, a0, false, out);
    case M_ENDSWITH: return affix(r, self, a0, true, out);
    case M_UPPER: return jj_case(r, self, 'u', out);
    case M_LOWER: return jj_case(r, self, 'l', out);
    case M_TITLE: return jj_case(r, self, 't', out);
    case M_CAPITALIZE: return jj_case(r, self, 'c', out);
    case M_REPLACE:
        if (!want_str(r, a0, "replace") || !want_str(r, a1, "replace")) return false;
        return jj_replace(r, self, a0, a1, a2 && a2->kind == JV_INT ? a2->u.i : -1, out);
    case M_FIND: case M_RFIND: case M_COUNT: return find(r, self, a0, id, out);
    case M_JOIN: return join(r, self, a0, out);
    case M_FORMAT: return str_format(r, self, a, out);
    default: *out = jv_bool(str_predicate(self, id)); return true;
    }
}

// ---- dict and loop methods ------------------------------------------------------------------------
static bool dict_method(jj_render *r, int id, const jv *self, const jj_args *a, jv *out) {
    if (id == M_GET) {
        const jv *key = jj_arg(a, 0, NULL), *def = jj_arg(a, 1, NULL);
        if (!key) return jj_fail(r, PD_ERR_INVALID, "line %d: get expected at least 1 argument", r->line);
        json_t *j = key->kind == JV_STR ? json_object_getn(self->u.j, jv_str_ptr(key), jv_str_len(key)) : NULL;
        *out = j ? jv_from_json(j) : def ? jv_copy(def) : jv_none();
        return true;
    }
    json_t *arr = json_array();
    const char *key;
    size_t key_len;
    json_t *val;
    if (!arr) return jj_fail_nomem(r);
    if (!jj_step(r, json_object_size(self->u.j))) {
        json_decref(arr);
        return false;
    }
    json_object_keylen_foreach(self->u.j, key, key_len, val) {
        json_t *e;
        if (id == M_KEYS) e = json_stringn_nocheck(key, key_len);
        else if (id == M_VALUES) e = json_incref(val);
        else e = json_pack("[s%O]", key, key_len, val);
        if (json_array_append_new(arr, e)) {
            json_decref(arr);
            return jj_fail_nomem(r);
        }
    }
    *out = jv_take_json(arr);
    return true;
}

bool jj_method_call(jj_render *r, int id, const jv *self, const jj_args *a, jv *out) {
    if (self->kind == JV_STR && id < M_N_STR) return str_method(r, id, self, a, out);
    if (self->kind == JV_DICT && id >= M_GET && id < M_CYCLE) return dict_method(r, id, self, a, out);
    if (self->kind == JV_LOOP && id == M_CYCLE) {
        const jj_loop *l = (const jj_loop *)self->u.o;
        if (!a->n_pos) return jj_fail(r, PD_ERR_INVALID, "line %d: no items for cycling given", r->line);
        *out = jv_copy(&a->pos[l->index0 % a->n_pos]);
        return true;
    }
    return jj_fail(r, PD_ERR_INVALID, "line %d: bad method call", r->line);
}
