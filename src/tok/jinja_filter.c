// jinja_filter.c — jinja2's builtin filters and tests, as chat templates use them, plus
// transformers' tojson.
//
// Filters: abs attr capitalize center count d default dictsort e escape first float format indent
//   int items join last length list lower map max min reject rejectattr replace reverse round safe
//   select selectattr sort string sum title tojson trim unique upper wordcount.
// Tests: defined undefined none boolean true false integer float number string mapping iterable
//   sequence callable odd even divisibleby eq equalto == ne != lt lessthan < le <= gt greaterthan >
//   ge >= in sameas lower upper escaped.
//
// tojson is transformers' override, not jinja2's: json.dumps(x, ensure_ascii=False, indent=indent,
// separators=separators, sort_keys=sort_keys) with those parameters in that positional order (so
// `tojson(4)` sets ensure_ascii, as it does in transformers) and no HTML escaping.
//
// Sorting (sort, dictsort, min, max) uses a stable merge sort so a comparison error can abort it;
// unique is quadratic and pays steps for it.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tok/jinja_impl.h"

enum {
    F_ABS = 0, F_ATTR, F_CAPITALIZE, F_CENTER, F_COUNT, F_D, F_DEFAULT, F_DICTSORT, F_E, F_ESCAPE,
    F_FIRST, F_FLOAT, F_FORMAT, F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER,
    F_MAP, F_MAX, F_MIN, F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT,
    F_SELECTATTR, F_SORT, F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER, F_WORDCOUNT,
    F_N,
};

static const char *const filter_names[F_N] = {
    "abs", "attr", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape",
    "first", "float", "format", "indent", "int", "items", "join", "last", "length", "list", "lower",
    "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round", "safe", "select",
    "selectattr", "sort", "string", "sum", "title", "tojson", "trim", "unique", "upper", "wordcount",
};

// Most positional arguments each filter takes (as in jinja2's signatures); more is an error.
static const uint8_t filter_max_pos[F_N] = {
    [F_ABS] = 0, [F_ATTR] = 1, [F_CAPITALIZE] = 0, [F_CENTER] = 1, [F_COUNT] = 0, [F_D] = 2,
    [F_DEFAULT] = 2, [F_DICTSORT] = 3, [F_E] = 0, [F_ESCAPE] = 0, [F_FIRST] = 0, [F_FLOAT] = 1,
    [F_FORMAT] = 255, [F_INDENT] = 3, [F_INT] = 2, [F_ITEMS] = 0, [F_JOIN] = 2, [F_LAST] = 0,
    [F_LENGTH] = 0, [F_LIST] = 0, [F_LOWER] = 0, [F_MAP] = 255, [F_MAX] = 2, [F_MIN] = 2,
    [F_REJECT] = 255, [F_REJECTATTR] = 255, [F_REPLACE] = 3, [F_REVERSE] = 0, [F_ROUND] = 2,
    [F_SAFE] = 0, [F_SELECT] = 255, [F_SELECTATTR] = 255, [F_SORT] = 3, [F_STRING] = 0, [F_SUM] = 2,
    [F_TITLE] = 0, [F_TOJSON] = 4, [F_TRIM] = 1, [F_UNIQUE] = 2, [F_UPPER] = 0, [F_WORDCOUNT] = 0,
};

int jj_filter_lookup(const char *name) {
    for (int k = 0; k < F_N; k++)
        if (!strcmp(filter_names[k], name)) return k;
    return -1;
}

enum {
    T_DEFINED = 0, T_UNDEFINED, T_NONE, T_BOOLEAN, T_TRUE, T_FALSE, T_INTEGER, T_FLOAT, T_NUMBER,
    T_STRING, T_MAPPING, T_ITERABLE, T_SEQUENCE, T_CALLABLE, T_ODD, T_EVEN, T_DIVISIBLEBY, T_EQ,
    T_NE, T_LT, T_LE, T_GT, T_GE, T_IN, T_SAMEAS, T_LOWER, T_UPPER, T_ESCAPED,
};

static const struct { const char *name; int id; } test_names[] = {
    {"defined", T_DEFINED}, {"undefined", T_UNDEFINED}, {"none", T_NONE}, {"boolean", T_BOOLEAN},
    {"true", T_TRUE}, {"false", T_FALSE}, {"integer", T_INTEGER}, {"float", T_FLOAT},
    {"number", T_NUMBER}, {"string", T_STRING}, {"mapping", T_MAPPING}, {"iterable", T_ITERABLE},
    {"sequence", T_SEQUENCE}, {"callable", T_CALLABLE}, {"odd", T_ODD}, {"even", T_EVEN},
    {"divisibleby", T_DIVISIBLEBY}, {"eq", T_EQ}, {"equalto", T_EQ}, {"==", T_EQ}, {"ne", T_NE},
    {"!=", T_NE}, {"lt", T_LT}, {"lessthan", T_LT}, {"<", T_LT}, {"le", T_LE}, {"<=", T_LE},
    {"gt", T_GT}, {"greaterthan", T_GT}, {">", T_GT}, {"ge", T_GE}, {">=", T_GE}, {"in", T_IN},
    {"sameas", T_SAMEAS}, {"lower", T_LOWER}, {"upper", T_UPPER}, {"escaped", T_ESCAPED},
};

int jj_test_lookup(const char *name) {
    for (size_t k = 0; k < PD_ARRAY_LEN(test_names); k++)
        if (!strcmp(test_names[k].name, name)) return test_names[k].id;
    return -1;
}

static bool fail_type(jj_render *r, const char *filter, const jv *v) {
    if (v->kind == JV_UNDEF && v->u.name)
        return jj_fail(r, PD_ERR_INVALID, "line %d: '%s' is undefined", r->line, v->u.name);
    return jj_fail(r, PD_ERR_INVALID, "line %d: filter %s does not accept a value of type '%s'", r->line,
                   filter, jv_type_name(v));
}

static bool as_bool_arg(const jv *v, bool def) { return v ? jv_truthy(v) : def; }

// ---- tests ----------------------------------------------------------------------------------------
static bool test_compare(jj_render *r, int id, const jv *in, const jv *other, bool *out) {
    int c;
    if (!other) return jj_fail(r, PD_ERR_INVALID, "line %d: test needs an argument", r->line);
    if (id == T_EQ || id == T_NE) {
        *out = jj_equal(in, other, 0) == (id == T_EQ);
        return true;
    }
    if (!jj_compare(r, in, other, &c)) return false;
    *out = id == T_LT ? c < 0 : id == T_LE ? c <= 0 : id == T_GT ? c > 0 : c >= 0;
    return true;
}

static bool test_sameas(const jv *a, const jv *b) {
    if (a->kind != b->kind) return false;
    switch (a->kind) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_BOOL: return a->u.b == b->u.b;
    case JV_INT: return a->u.i == b->u.i;
    case JV_FLOAT: return a->u.f == b->u.f;
    case JV_FUNC: case JV_LOOP: return a->u.o == b->u.o;
    default: return a->u.j == b->u.j;
    }
}

bool jj_test_apply(jj_render *r, int id, const jv *in, const jj_args *a, bool *out) {
    const jv *arg = jj_arg(a, 0, NULL);
    bool is_int = in->kind == JV_INT || in->kind == JV_BOOL;
    switch (id) {
    case T_DEFINED: *out = in->kind != JV_UNDEF; return true;
    case T_UNDEFINED: *out = in->kind == JV_UNDEF; return true;
    case T_NONE: *out = in->kind == JV_NONE; return true;
    case T_BOOLEAN: *out = in->kind == JV_BOOL; return true;
    case T_TRUE: *out = in->kind == JV_BOOL && in->u.b; return true;
    case T_FALSE: *out = in->kind == JV_BOOL && !in->u.b; return true;
    case T_INTEGER: *out = in->kind == JV_INT; return true;
    case T_FLOAT: *out = in->kind == JV_FLOAT; return true;
    case T_NUMBER: *out = jv_is_num(in); return true;
    case T_STRING: *out = in->kind == JV_STR; return true;
    case T_MAPPING: *out = in->kind == JV_DICT; return true;
    case T_ITERABLE: *out = in->kind == JV_STR || in->kind == JV_LIST || in->kind == JV_DICT ||
                            in->kind == JV_UNDEF || in->kind == JV_LOOP; return true;
    case T_SEQUENCE: *out = in->kind == JV_STR || in->kind == JV_LIST || in->kind == JV_DICT ||
                            in->kind == JV_UNDEF; return true;
    case T_CALLABLE: *out = in->kind == JV_FUNC; return true;
    case T_ODD: case T_EVEN: case T_DIVISIBLEBY: {
        if (!jv_is_num(in)) return fail_type(r, "divisibleby", in);
        jv m = id == T_DIVISIBLEBY ? (arg ? *arg : jv_none()) : jv_int(2);
        if (!jv_is_num(&m)) return jj_fail(r, PD_ERR_INVALID, "line %d: divisibleby needs a number", r->line);
        double d = jv_as_double(&m);
        if (d == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: division by zero", r->line);
        double rem = is_int && m.kind != JV_FLOAT ? (double)((in->kind == JV_BOOL ? in->u.b : in->u.i) % (int64_t)d)
                                                  : fmod(jv_as_double(in), d);
        if (id == T_ODD) *out = rem != 0;
        else *out = rem == 0;
        return true;
    }
    case T_EQ: case T_NE: case T_LT: case T_LE: case T_GT: case T_GE: return test_compare(r, id, in, arg, out);
    case T_IN: {
        if (!arg) return jj_fail(r, PD_ERR_INVALID, "line %d: test 'in' needs an argument", r->line);
        json_t *list;
        if (arg->kind == JV_STR) {
            if (in->kind != JV_STR) return jj_fail(r, PD_ERR_INVALID, "line %d: 'in <string>' requires string as left operand", r->line);
            *out = jv_str_len(in) == 0 || memmem(jv_str_ptr(arg), jv_str_len(arg), jv_str_ptr(in), jv_str_len(in));
            return true;
        }
        if (!jj_iter_list(r, arg, &list)) return false;
        *out = false;
        for (size_t k = 0; k < json_array_size(list) && !*out; k++) {
            jv e = jv_from_json(json_array_get(list, k));
            *out = jj_equal(&e, in, 0);
            jv_drop(&e);
        }
        json_decref(list);
        return true;
    }
    case T_SAMEAS: *out = arg && test_sameas(in, arg); return true;
    case T_LOWER: case T_UPPER: {
        jv s, res;
        jj_args none = {0};
        if (!jj_to_str(r, in, &s)) return false;
        bool ok = jj_method_call(r, jj_method_lookup(&s, id == T_LOWER ? "islower" : "isupper"), &s, &none, &res);
        jv_drop(&s);
        if (ok) *out = res.kind == JV_BOOL && res.u.b;
        return ok;
    }
    default: *out = false; return true;
    }
}

// ---- sorting --------------------------------------------------------------------------------------
typedef struct sort_item {
    jv key;        // owned
    json_t *item;  // borrowed from the source array
} sort_item;

static bool merge_sort(jj_render *r, sort_item *v, sort_item *tmp, size_t n, bool reverse) {
    if (n < 2) return true;
    size_t h = n / 2;
    if (!merge_sort(r, v, tmp, h, reverse) || !merge_sort(r, v + h, tmp, n - h, reverse)) return false;
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c;
        if (!jj_compare(r, &v[j].key, &v[i].key, &c)) return false;
        if (reverse) c = -c;
        tmp[k++] = c < 0 ? v[j++] : v[i++];  // stable: ties take the left run
    }
    while (i < h) tmp[k++] = v[i++];
    while (j < n) tmp[k++] = v[j++];
    memcpy(v, tmp, n * sizeof *v);
    return true;
}

static void sort_items_free(sort_item *v, size_t n) {
    for (size_t k = 0; k < n; k++) jv_drop(&v[k].key);
    pd_free(v);
}

// Builds sort keys for each item of list: the attribute (if any), case-folded unless case_sensitive.
static bool sort_keys(jj_render *r, json_t *list, const jv *attr, bool case_sensitive, sort_item **out) {
    size_t n = json_array_size(list);
    sort_item *v = pd_calloc(n ? n : 1, sizeof *v);
    if (!v) return jj_fail_nomem(r);
    for (size_t k = 0; k < n; k++) {
        jv item = jv_from_json(json_array_get(list, k)), key;
        bool ok = attr && attr->kind != JV_NONE ? jj_getpath(r, &item, attr, &key) : (key = jv_copy(&item), true);
        jv_drop(&item);
        if (ok && !case_sensitive) {
            jv folded;
            ok = jj_fold_case(r, &key, &folded);
            jv_drop(&key);
            key = folded;
        }
        if (!ok) {
            sort_items_free(v, k);
            return false;
        }
        v[k].key = key;
        v[k].item = json_array_get(list, k);
    }
    *out = v;
    return true;
}

static bool do_sort(jj_render *r, json_t *list, const jv *attr, bool case_sensitive, bool reverse,
                    json_t **out) {
    size_t n = json_array_size(list);
    sort_item *v, *tmp;
    if (!jj_step(r, n * 8)) return false;
    if (!sort_keys(r, list, attr, case_sensitive, &v)) return false;
    tmp = pd_malloc((n ? n : 1) * sizeof *tmp);
    bool ok = tmp ? merge_sort(r, v, tmp, n, reverse) : jj_fail_nomem(r);
    pd_free(tmp);
    json_t *arr = ok ? json_array() : NULL;
    for (size_t k = 0; arr && k < n; k++)
        if (json_array_append(arr, v[k].item)) { json_decref(arr); arr = NULL; }
    sort_items_free(v, n);
    if (ok && !arr) return jj_fail_nomem(r);
    *out = arr;
    return ok;
}

// ---- filters --------------------------------------------------------------------------------------
static bool f_length(jj_render *r, const jv *in, jv *out) {
    switch (in->kind) {
    case JV_UNDEF: *out = jv_int(0); return true;
    case JV_STR: *out = jv_int((int64_t)jj_utf8_count(jv_str_ptr(in), jv_str_len(in))); return true;
    case JV_LIST: *out = jv_int((int64_t)json_array_size(in->u.j)); return true;
    case JV_DICT: *out = jv_int((int64_t)json_object_size(in->u.j)); return true;
    case JV_LOOP: *out = jv_int((int64_t)((const jj_loop *)in->u.o)->length); return true;
    default:
        return jj_fail(r, PD_ERR_INVALID, "line %d: object of type '%s' has no len()", r->line, jv_type_name(in));
    }
}

static bool f_first_last(jj_render *r, const jv *in, bool last, jv *out) {
    json_t *list;
    if (in->kind == JV_STR && jv_str_len(in)) {
        const char *s = jv_str_ptr(in);
        size_t n = jv_str_len(in), a = 0, b = 0;
        if (last) {
            a = n - 1;
            while (a > 0 && ((unsigned char)s[a] & 0xC0) == 0x80) a--;
            b = n;
        } else {
            jj_utf8_next(s, n, &b);
        }
        return jj_str_new(r, s + a, b - a, out);
    }
    if (!jj_iter_list(r, in, &list)) return false;
    size_t n = json_array_size(list);
    *out = n ? jv_from_json(json_array_get(list, last ? n - 1 : 0)) : jv_undef(NULL);
    json_decref(list);
    return true;
}

// Python float(str): optional whitespace, sign, digits with '_', inf/nan.
static bool parse_float(const char *s, size_t n, double *out) {
    char buf[128];
    size_t k = 0, i = jj_lstrip_off(s, n), end = jj_rstrip_len(s, n);
    if (i >= end || end - i >= sizeof buf) return false;
    for (; i < end; i++) {
        if (s[i] == '_') {
            if (!k || i + 1 >= end || !(s[i + 1] >= '0' && s[i + 1] <= '9') || !(buf[k - 1] >= '0' && buf[k - 1] <= '9')) return false;
            continue;
        }
        if (!strchr("0123456789+-.eEinfatyINFATY", s[i])) return false;
        buf[k++] = s[i];
    }
    buf[k] = 0;
    char *e;
    *out = strtod(buf, &e);
    if (*e) return false;
    const char *b = buf + (buf[0] == '+' || buf[0] == '-');
    if ((b[0] == 'i' || b[0] == 'I') && strcasecmp(b, "inf") && strcasecmp(b, "infinity")) return false;
    if ((b[0] == 'n' || b[0] == 'N') && strcasecmp(b, "nan")) return false;
    return strchr("0123456789.", b[0]) || !strcasecmp(b, "inf") || !strcasecmp(b, "infinity") || !strcasecmp(b, "nan");
}

static bool parse_int(const char *s, size_t n, int base, int64_t *out) {
    size_t i = jj_lstrip_off(s, n), end = jj_rstrip_len(s, n);
    bool neg = false;
    if (i < end && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    if (base == 16 && i + 1 < end && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X')) i += 2;
    if (i >= end) return false;
    uint64_t v = 0;
    bool prev_digit = false;
    for (; i < end; i++) {
        char c = s[i];
        if (c == '_' && prev_digit && i + 1 < end) { prev_digit = false; continue; }
        int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'z') ? c - 'a' + 10 : (c >= 'A' && c <= 'Z') ? c - 'A' + 10 : 99;
        if (d >= base) return false;
        if (v > ((uint64_t)INT64_MAX + (neg ? 1u : 0u) - (uint64_t)d) / (uint64_t)base) return false;
        v = v * (uint64_t)base + (uint64_t)d;
        prev_digit = true;
    }
    if (!prev_digit) return false;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
}

static bool f_int(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *def = jj_arg(a, 0, "default"), *basev = jj_arg(a, 1, "base");
    int base = basev && basev->kind == JV_INT && basev->u.i >= 2 && basev->u.i <= 36 ? (int)basev->u.i : 10;
    int64_t v;
    double f;
    switch (in->kind) {
    case JV_INT: *out = *in; return true;
    case JV_BOOL: *out = jv_int(in->u.b); return true;
    case JV_FLOAT:
        if (isfinite(in->u.f) && fabs(in->u.f) < 9.2e18) { *out = jv_int((int64_t)in->u.f); return true; }
        break;
    case JV_STR:
        if (parse_int(jv_str_ptr(in), jv_str_len(in), base, &v)) { *out = jv_int(v); return true; }
        if (parse_float(jv_str_ptr(in), jv_str_len(in), &f) && isfinite(f) && fabs(f) < 9.2e18) {
            *out = jv_int((int64_t)f);
            return true;
        }
        break;
    default: break;
    }
    *out = def ? jv_copy(def) : jv_int(0);
    return true;
}

static bool f_float(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *def = jj_arg(a, 0, "default");
    double f;
    PD_UNUSED(r);
    if (jv_is_num(in)) *out = jv_float(jv_as_double(in));
    else if (in->kind == JV_STR && parse_float(jv_str_ptr(in), jv_str_len(in), &f)) *out = jv_float(f);
    else *out = def ? jv_copy(def) : jv_float(0.0);
    return true;
}

static bool f_join(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *sep = jj_arg(a, 0, "d"), *attr = jj_arg(a, 1, "attribute");
    jv sepv = jv_undef(NULL);
    json_t *list;
    if (sep && !jj_to_str(r, sep, &sepv)) return false;
    if (!jj_iter_list(r, in, &list)) {
        jv_drop(&sepv);
        return false;
    }
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    bool ok = true;
    for (size_t k = 0; ok && k < json_array_size(list); k++) {
        jv item = jv_from_json(json_array_get(list, k)), val;
        ok = attr && attr->kind != JV_NONE ? jj_getpath(r, &item, attr, &val) : (val = jv_copy(&item), true);
        if (ok && k && sep) ok = jj_write_str(r, &b, &sepv);
        if (ok) {
            ok = jj_write_str(r, &b, &val);
            jv_drop(&val);
        }
        jv_drop(&item);
    }
    json_decref(list);
    jv_drop(&sepv);
    if (!ok) {
        jj_buf_fini(&b);
        return false;
    }
    return jj_str_from_buf(r, &b, out);
}

static bool f_items(jj_render *r, const jv *in, jv *out) {
    if (in->kind == JV_UNDEF) {
        *out = jv_take_json(json_array());
        return out->kind == JV_LIST ? true : jj_fail_nomem(r);
    }
    if (in->kind != JV_DICT)
        return jj_fail(r, PD_ERR_INVALID, "line %d: Can only get item pairs from a mapping.", r->line);
    jj_args none = {0};
    return jj_method_call(r, jj_method_lookup(in, "items"), in, &none, out);
}

static bool f_dictsort(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    bool cs = as_bool_arg(jj_arg(a, 0, "case_sensitive"), false);
    const jv *by = jj_arg(a, 1, "by");
    bool reverse = as_bool_arg(jj_arg(a, 2, "reverse"), false);
    int pos = 0;
    if (by && by->kind == JV_STR && !strcmp(jv_str_ptr(by), "value")) pos = 1;
    else if (by && !(by->kind == JV_STR && !strcmp(jv_str_ptr(by), "key")))
        return jj_fail(r, PD_ERR_INVALID, "line %d: You can only sort by either \"key\" or \"value\"", r->line);
    jv items;
    if (!f_items(r, in, &items)) return false;
    jv path = jv_int(pos);
    json_t *sorted;
    bool ok = do_sort(r, items.u.j, &path, cs, reverse, &sorted);
    jv_drop(&items);
    if (ok) *out = jv_take_json(sorted);
    return ok;
}

// select/reject (attr == NULL) and selectattr/rejectattr.
static bool f_select(jj_render *r, const jv *in, const jj_args *a, bool with_attr, bool want, jv *out) {
    size_t first = with_attr ? 1 : 0;
    const jv *attr = with_attr ? jj_arg(a, 0, NULL) : NULL;
    const jv *test = jj_arg(a, (int)first, NULL);
    if (with_attr && !attr) return jj_fail(r, PD_ERR_INVALID, "line %d: Missing parameter for attribute name", r->line);
    int test_id = -1;
    if (test) {
        if (test->kind != JV_STR || (test_id = jj_test_lookup(jv_str_ptr(test))) < 0)
            return jj_fail(r, PD_ERR_INVALID, "line %d: No test named '%s'.", r->line,
                           test->kind == JV_STR ? jv_str_ptr(test) : "?");
    }
    jj_args targs = {.pos = a->n_pos > first + 1 ? a->pos + first + 1 : NULL,
                     .n_pos = a->n_pos > first + 1 ? a->n_pos - first - 1 : 0,
                     .kwnames = a->kwnames, .kw = a->kw, .n_kw = a->n_kw};
    json_t *list, *kept = json_array();
    if (!kept) return jj_fail_nomem(r);
    if (!jj_iter_list(r, in, &list)) {
        json_decref(kept);
        return false;
    }
    bool ok = true;
    for (size_t k = 0; ok && k < json_array_size(list); k++) {
        jv item = jv_from_json(json_array_get(list, k)), val;
        bool hit = false;
        ok = attr ? jj_getpath(r, &item, attr, &val) : (val = jv_copy(&item), true);
        if (ok) {
            ok = test_id >= 0 ? jj_test_apply(r, test_id, &val, &targs, &hit) : (hit = jv_truthy(&val), true);
            jv_drop(&val);
        }
        if (ok && hit == want && json_array_append(kept, json_array_get(list, k))) ok = jj_fail_nomem(r);
        jv_drop(&item);
    }
    json_decref(list);
    if (!ok) {
        json_decref(kept);
        return false;
    }
    *out = jv_take_json(kept);
    return true;
}

static bool f_map(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *attr = jj_arg(a, -1, "attribute"), *def = jj_arg(a, -1, "default");
    int filter_id = -1;
    jj_args fargs = {0};
    if (!attr) {
        const jv *name = jj_arg(a, 0, NULL);
        if (!name || name->kind != JV_STR || (filter_id = jj_filter_lookup(jv_str_ptr(name))) < 0)
            return jj_fail(r, PD_ERR_INVALID, "line %d: map needs attribute= or a filter name", r->line);
        fargs = (jj_args){.pos = a->pos + 1, .n_pos = a->n_pos - 1, .kwnames = a->kwnames, .kw = a->kw, .n_kw = a->n_kw};
    }
    json_t *list, *res = json_array();
    if (!res) return jj_fail_nomem(r);
    if (!jj_iter_list(r, in, &list)) {
        json_decref(res);
        return false;
    }
    bool ok = true;
    for (size_t k = 0; ok && k < json_array_size(list); k++) {
        jv item = jv_from_json(json_array_get(list, k)), val;
        if (attr) {
            ok = jj_getpath(r, &item, attr, &val);
            if (ok && val.kind == JV_UNDEF && def) {
                jv_drop(&val);
                val = jv_copy(def);
            }
        } else {
            ok = jj_filter_apply(r, filter_id, &item, &fargs, &val);
        }
        if (ok) {
            if (json_array_append_new(res, jv_to_json(&val))) ok = jj_fail_nomem(r);
            jv_drop(&val);
        }
        jv_drop(&item);
    }
    json_decref(list);
    if (!ok) {
        json_decref(res);
        return false;
    }
    *out = jv_take_json(res);
    return true;
}

static bool f_minmax(jj_render *r, const jv *in, const jj_args *a, bool is_max, jv *out) {
    bool cs = as_bool_arg(jj_arg(a, 0, "case_sensitive"), false);
    const jv *attr = jj_arg(a, 1, "attribute");
    json_t *list;
    if (!jj_iter_list(r, in, &list)) return false;
    size_t n = json_array_size(list);
    sort_item *v;
    if (!n) {
        json_decref(list);
        *out = jv_undef(NULL);
        return true;
    }
    if (!sort_keys(r, list, attr, cs, &v)) {
        json_decref(list);
        return false;
    }
    size_t best = 0;
    bool ok = true;
    for (size_t k = 1; ok && k < n; k++) {
        int c;
        ok = jj_compare(r, &v[k].key, &v[best].key, &c);
        if (ok && (is_max ? c > 0 : c < 0)) best = k;
    }
    if (ok) *out = jv_from_json(v[best].item);
    sort_items_free(v, n);
    json_decref(list);
    return ok;
}

static bool f_unique(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    bool cs = as_bool_arg(jj_arg(a, 0, "case_sensitive"), false);
    const jv *attr = jj_arg(a, 1, "attribute");
    json_t *list;
    sort_item *v;
    if (!jj_iter_list(r, in, &list)) return false;
    size_t n = json_array_size(list);
    if (!jj_step(r, n * n / 4 + 1) || !sort_keys(r, list, attr, cs, &v)) {
        json_decref(list);
        return false;
    }
    json_t *res = json_array();
    bool ok = res != NULL;
    for (size_t k = 0; ok && k < n; k++) {
        bool seen = false;
        for (size_t j = 0; j < k && !seen; j++) seen = jj_equal(&v[j].key, &v[k].key, 0);
        if (!seen && json_array_append(res, v[k].item)) ok = false;
    }
    sort_items_free(v, n);
    json_decref(list);
    if (!ok) {
        json_decref(res);
        return jj_fail_nomem(r);
    }
    *out = jv_take_json(res);
    return true;
}

static bool f_reverse(jj_render *r, const jv *in, jv *out) {
    if (in->kind == JV_STR) {
        const char *s = jv_str_ptr(in);
        size_t n = jv_str_len(in), end = n;
        jj_buf b;
        jj_buf_init(&b, r->lim.max_output_bytes);
        while (end > 0) {
            size_t a = end - 1;
            while (a > 0 && ((unsigned char)s[a] & 0xC0) == 0x80) a--;
            jj_buf_put(&b, s + a, end - a);
            end = a;
        }
        return jj_str_from_buf(r, &b, out);
    }
    json_t *list, *res = json_array();
    if (!res) return jj_fail_nomem(r);
    if (!jj_iter_list(r, in, &list)) {
        json_decref(res);
        return false;
    }
    for (size_t k = json_array_size(list); k > 0; k--) {
        if (json_array_append(res, json_array_get(list, k - 1))) {
            json_decref(list);
            json_decref(res);
            return jj_fail_nomem(r);
        }
    }
    json_decref(list);
    *out = jv_take_json(res);
    return true;
}

static bool f_round(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *precv = jj_arg(a, 0, "precision"), *method = jj_arg(a, 1, "method");
    int64_t prec = precv && (precv->kind == JV_INT) ? precv->u.i : 0;
    const char *m = method && method->kind == JV_STR ? jv_str_ptr(method) : "common";
    if (!jv_is_num(in)) return fail_type(r, "round", in);
    if (strcmp(m, "common") && strcmp(m, "ceil") && strcmp(m, "floor"))
        return jj_fail(r, PD_ERR_INVALID, "line %d: method must be common, ceil or floor", r->line);
    if (prec > 300) prec = 300;
    if (prec < -300) prec = -300;
    if (!strcmp(m, "common")) {
        if (in->kind != JV_FLOAT && prec >= 0) {  // round(int, n) stays an int
            *out = jv_int(in->kind == JV_BOOL ? in->u.b : in->u.i);
            return true;
        }
        double x = jv_as_double(in), res;
        if (prec >= 0 && prec <= 30) {
            char buf[400];
            snprintf(buf, sizeof buf, "%.*f", (int)prec, x);  // exact decimal, ties to even: as Python
            res = strtod(buf, NULL);
        } else {
            double p = pow(10.0, (double)prec);
            res = prec >= 0 ? x : nearbyint(x * p) / p;
        }
        if (in->kind != JV_FLOAT) *out = jv_int((int64_t)res);
        else *out = jv_float(res);
        return true;
    }
    double p = pow(10.0, (double)prec), x = jv_as_double(in) * p;
    *out = jv_float((!strcmp(m, "ceil") ? ceil(x) : floor(x)) / p);
    return true;
}

static bool f_indent(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *w = jj_arg(a, 0, "width");
    bool first = as_bool_arg(jj_arg(a, 1, "first"), false), blank = as_bool_arg(jj_arg(a, 2, "blank"), false);
    jv s, ind;
    if (w && w->kind == JV_STR) ind = jv_copy(w);
    else {
        int64_t n = w && (w->kind == JV_INT) ? w->u.i : 4;
        char sp[256];
        if (n < 0) n = 0;
        if (n > 255) n = 255;
        memset(sp, ' ', (size_t)n);
        if (!jj_str_new(r, sp, (size_t)n, &ind)) return false;
    }
    if (!jj_to_str(r, in, &s)) {
        jv_drop(&ind);
        return false;
    }
    // jinja2: (s + "\n").splitlines(), the first line unindented unless first, blank lines kept bare
    // unless blank; lines are joined with "\n".
    jv lines;
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    jj_buf_put(&b, jv_str_ptr(&s), jv_str_len(&s));
    jj_buf_putc(&b, '\n');
    jv s2;
    bool ok = jj_str_from_buf(r, &b, &s2);
    jv_drop(&s);
    if (!ok) {
        jv_drop(&ind);
        return false;
    }
    jj_args none = {0};
    ok = jj_method_call(r, jj_method_lookup(&s2, "splitlines"), &s2, &none, &lines);
    jv_drop(&s2);
    if (!ok) {
        jv_drop(&ind);
        return false;
    }
    jj_buf_init(&b, r->lim.max_output_bytes);
    if (first) jj_buf_put(&b, jv_str_ptr(&ind), jv_str_len(&ind));
    for (size_t k = 0; k < json_array_size(lines.u.j); k++) {
        json_t *line = json_array_get(lines.u.j, k);
        if (k) {
            jj_buf_putc(&b, '\n');
            if (blank || json_string_length(line)) jj_buf_put(&b, jv_str_ptr(&ind), jv_str_len(&ind));
        }
        jj_buf_put(&b, json_string_value(line), json_string_length(line));
    }
    jv_drop(&lines);
    jv_drop(&ind);
    return jj_str_from_buf(r, &b, out);
}

static bool f_escape(jj_render *r, const jv *in, jv *out) {
    jv s;
    if (!jj_to_str(r, in, &s)) return false;
    const char *p = jv_str_ptr(&s);
    size_t n = jv_str_len(&s);
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    for (size_t k = 0; k < n; k++) {
        switch (p[k]) {
        case '&': jj_buf_puts(&b, "&amp;"); break;
        case '<': jj_buf_puts(&b, "&lt;"); break;
        case '>': jj_buf_puts(&b, "&gt;"); break;
        case '"': jj_buf_puts(&b, "&#34;"); break;
        case '\'': jj_buf_puts(&b, "&#39;"); break;
        default: jj_buf_putc(&b, p[k]); break;
        }
    }
    jv_drop(&s);
    return jj_str_from_buf(r, &b, out);
}

static bool f_tojson(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    static const char *const names[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    if (!jj_args_check(r, a, "tojson", 4, names)) return false;
    const jv *ea = jj_arg(a, 0, "ensure_ascii"), *ind = jj_arg(a, 1, "indent");
    const jv *seps = jj_arg(a, 2, "separators"), *sk = jj_arg(a, 3, "sort_keys");
    char spaces[256];
    jj_json_fmt fmt = {.item_sep = ", ", .key_sep = ": ", .ensure_ascii = as_bool_arg(ea, false),
                       .sort_keys = as_bool_arg(sk, false)};
    if (ind && ind->kind == JV_STR) {
        fmt.indent = jv_str_ptr(ind);
        fmt.indent_len = jv_str_len(ind);
    } else if (ind && (ind->kind == JV_INT || ind->kind == JV_BOOL)) {
        int64_t n = ind->kind == JV_BOOL ? ind->u.b : ind->u.i;
        if (n < 0) n = 0;
        if (n > 255) n = 255;
        memset(spaces, ' ', (size_t)n);
        fmt.indent = spaces;
        fmt.indent_len = (size_t)n;
    } else if (ind && ind->kind != JV_NONE) {
        return jj_fail(r, PD_ERR_INVALID, "line %d: tojson indent must be an int or a string", r->line);
    }
    if (fmt.indent) fmt.item_sep = ",";
    if (seps && seps->kind != JV_NONE) {
        json_t *i = seps->kind == JV_LIST ? json_array_get(seps->u.j, 0) : NULL;
        json_t *k = seps->kind == JV_LIST ? json_array_get(seps->u.j, 1) : NULL;
        if (!json_is_string(i) || !json_is_string(k) || json_array_size(seps->u.j) != 2)
            return jj_fail(r, PD_ERR_INVALID, "line %d: tojson separators must be two strings", r->line);
        fmt.item_sep = json_string_value(i);
        fmt.key_sep = json_string_value(k);
    }
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    if (!jj_write_json(r, &b, in, &fmt)) {
        jj_buf_fini(&b);
        return false;
    }
    return jj_str_from_buf(r, &b, out);
}

static bool f_sum(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *attr = jj_arg(a, 0, "attribute"), *start = jj_arg(a, 1, "start");
    json_t *list;
    if (!jj_iter_list(r, in, &list)) return false;
    jv acc = start ? jv_copy(start) : jv_int(0);
    bool ok = true;
    for (size_t k = 0; ok && k < json_array_size(list); k++) {
        jv item = jv_from_json(json_array_get(list, k)), val;
        ok = attr && attr->kind != JV_NONE ? jj_getpath(r, &item, attr, &val) : (val = jv_copy(&item), true);
        jv_drop(&item);
        if (!ok) break;
        if (!jv_is_num(&acc) || !jv_is_num(&val)) ok = fail_type(r, "sum", jv_is_num(&acc) ? &val : &acc);
        else if (acc.kind != JV_FLOAT && val.kind != JV_FLOAT) {
            int64_t x = acc.kind == JV_BOOL ? acc.u.b : acc.u.i, y = val.kind == JV_BOOL ? val.u.b : val.u.i;
            if (__builtin_add_overflow(x, y, &x)) ok = jj_fail(r, PD_ERR_INVALID, "line %d: integer overflow", r->line);
            acc = jv_int(x);
        } else {
            acc = jv_float(jv_as_double(&acc) + jv_as_double(&val));
        }
        jv_drop(&val);
    }
    json_decref(list);
    if (!ok) {
        jv_drop(&acc);
        return false;
    }
    *out = acc;
    return true;
}

static bool f_center(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *wv = jj_arg(a, 0, "width");
    int64_t width = wv && wv->kind == JV_INT ? wv->u.i : 80;
    jv s;
    if (!jj_to_str(r, in, &s)) return false;
    int64_t len = (int64_t)jj_utf8_count(jv_str_ptr(&s), jv_str_len(&s));
    if (width <= len || width > (int64_t)r->lim.max_output_bytes) {
        *out = s;
        return true;
    }
    int64_t marg = width - len, left = marg / 2 + (marg & width & 1);
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    for (int64_t k = 0; k < left; k++) jj_buf_putc(&b, ' ');
    jj_buf_put(&b, jv_str_ptr(&s), jv_str_len(&s));
    for (int64_t k = 0; k < marg - left; k++) jj_buf_putc(&b, ' ');
    jv_drop(&s);
    return jj_str_from_buf(r, &b, out);
}

static bool f_wordcount(jj_render *r, const jv *in, jv *out) {
    jv s;
    if (!jj_to_str(r, in, &s)) return false;
    const char *p = jv_str_ptr(&s);
    size_t n = jv_str_len(&s), i = 0;
    int64_t count = 0;
    bool in_word = false;
    while (i < n) {
        uint32_t cp = jj_utf8_next(p, n, &i);
        // Python's \w, approximately: ASCII alphanumerics and '_', and non-ASCII code points
        // outside the punctuation, symbol and emoji blocks.
        bool symbol = (cp >= 0x80 && cp <= 0xBF && cp != 0xAA && cp != 0xB2 && cp != 0xB3 && cp != 0xB5 &&
                       cp != 0xB9 && cp != 0xBA && cp != 0xBC && cp != 0xBD && cp != 0xBE) ||
                      cp == 0xD7 || cp == 0xF7 || (cp >= 0x2000 && cp <= 0x2BFF) || (cp >= 0x3000 && cp <= 0x303F) ||
                      (cp >= 0xFE00 && cp <= 0xFE0F) || (cp >= 0xFF00 && cp <= 0xFF0F) || (cp >= 0x1F000 && cp <= 0x1FAFF);
        bool w = (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_' ||
                 (cp >= 0x80 && !jj_is_space(cp) && !symbol);
        if (w && !in_word) count++;
        in_word = w;
    }
    jv_drop(&s);
    *out = jv_int(count);
    return true;
}

static bool f_attr(jj_render *r, const jv *in, const jj_args *a, jv *out) {
    const jv *name = jj_arg(a, 0, "name");
    if (!name || name->kind != JV_STR) return jj_fail(r, PD_ERR_INVALID, "line %d: attr needs a name", r->line);
    // Python getattr: namespaces and loops have attributes; a dict's keys are not attributes.
    if (in->kind == JV_DICT) {
        int m = jj_method_lookup(in, jv_str_ptr(name));
        if (m < 0) {
            *out = jv_undef(NULL);
            return true;
        }
    }
    return jj_getattr(r, in, jv_str_ptr(name), jv_str_len(name), out);
}

static bool string_filter(jj_render *r, int id, const jv *in, const jj_args *a, jv *out) {
    jv s;
    bool ok;
    if (!jj_to_str(r, in, &s)) return false;
    switch (id) {
    case F_TRIM: ok = jj_strip(r, &s, jj_arg(a, 0, "chars"), 'b', out); break;
    case F_REPLACE: {
        const jv *old = jj_arg(a, 0, "old"), *repl = jj_arg(a, 1, "new"), *cnt = jj_arg(a, 2, "count");
        jv o = jv_undef(NULL), p = jv_undef(NULL);
        ok = old && repl && jj_to_str(r, old, &o) && jj_to_str(r, repl, &p);
        if (ok) ok = jj_replace(r, &s, &o, &p, cnt && cnt->kind == JV_INT ? cnt->u.i : -1, out);
        else if (r->status == PD_OK) jj_fail(r, PD_ERR_INVALID, "line %d: replace needs old and new", r->line);
        jv_drop(&o);
        jv_drop(&p);
        break;
    }
    case F_FORMAT: {
        jv args = jv_undef(NULL);
        json_t *arr = json_array();
        ok = arr != NULL;
        for (size_t k = 0; ok && k < a->n_pos; k++) ok = !json_array_append_new(arr, jv_to_json(&a->pos[k]));
        if (ok) {
            args = jv_take_json(arr);
            ok = jj_percent_format(r, &s, &args, out);
        } else {
            json_decref(arr);
            jj_fail_nomem(r);
        }
        jv_drop(&args);
        break;
    }
    default: ok = jj_case(r, &s, id == F_UPPER ? 'u' : id == F_LOWER ? 'l' : id == F_CAPITALIZE ? 'c' : 'j', out);
    }
    jv_drop(&s);
    return ok;
}

bool jj_filter_apply(jj_render *r, int id, const jv *in, const jj_args *a, jv *out) {
    if (id >= 0 && id < F_N && a->n_pos > filter_max_pos[id])
        return jj_fail(r, PD_ERR_INVALID, "line %d: filter %s takes at most %d positional argument(s), got %zu",
                       r->line, filter_names[id], filter_max_pos[id], a->n_pos);
    switch (id) {
    case F_ABS:
        if (in->kind == JV_FLOAT) *out = jv_float(fabs(in->u.f));
        else if (in->kind == JV_INT && in->u.i != INT64_MIN) *out = jv_int(in->u.i < 0 ? -in->u.i : in->u.i);
        else if (in->kind == JV_BOOL) *out = jv_int(in->u.b);
        else return fail_type(r, "abs", in);
        return true;
    case F_ATTR: return f_attr(r, in, a, out);
    case F_CENTER: return f_center(r, in, a, out);
    case F_COUNT: case F_LENGTH: return f_length(r, in, out);
    case F_D: case F_DEFAULT: {
        const jv *def = jj_arg(a, 0, "default_value"), *boolean = jj_arg(a, 1, "boolean");
        bool use_def = in->kind == JV_UNDEF || (as_bool_arg(boolean, false) && !jv_truthy(in));
        if (!use_def) *out = jv_copy(in);
        else if (def) *out = jv_copy(def);
        else return jj_str_new(r, "", 0, out);
        return true;
    }
    case F_DICTSORT: return f_dictsort(r, in, a, out);
    case F_E: case F_ESCAPE: return f_escape(r, in, out);
    case F_FIRST: case F_LAST: return f_first_last(r, in, id == F_LAST, out);
    case F_FLOAT: return f_float(r, in, a, out);
    case F_INDENT: return f_indent(r, in, a, out);
    case F_INT: return f_int(r, in, a, out);
    case F_ITEMS: return f_items(r, in, out);
    case F_JOIN: return f_join(r, in, a, out);
    case F_LIST: {
        json_t *list;
        if (!jj_iter_list(r, in, &list)) return false;
        *out = jv_take_json(list);
        return true;
    }
    case F_MAP: return f_map(r, in, a, out);
    case F_MAX: case F_MIN: return f_minmax(r, in, a, id == F_MAX, out);
    case F_REJECT: case F_SELECT: return f_select(r, in, a, false, id == F_SELECT, out);
    case F_REJECTATTR: case F_SELECTATTR: return f_select(r, in, a, true, id == F_SELECTATTR, out);
    case F_REVERSE: return f_reverse(r, in, out);
    case F_ROUND: return f_round(r, in, a, out);
    case F_SAFE: case F_STRING: return jj_to_str(r, in, out);
    case F_SORT: {
        json_t *list, *sorted;
        if (!jj_iter_list(r, in, &list)) return false;
        bool ok = do_sort(r, list, jj_arg(a, 2, "attribute"), as_bool_arg(jj_arg(a, 1, "case_sensitive"), false),
                          as_bool_arg(jj_arg(a, 0, "reverse"), false), &sorted);
        json_decref(list);
        if (ok) *out = jv_take_json(sorted);
        return ok;
    }
    case F_SUM: return f_sum(r, in, a, out);
    case F_TOJSON: return f_tojson(r, in, a, out);
    case F_UNIQUE: return f_unique(r, in, a, out);
    case F_WORDCOUNT: return f_wordcount(r, in, out);
    case F_CAPITALIZE: case F_FORMAT: case F_LOWER: case F_REPLACE: case F_TITLE: case F_TRIM: case F_UPPER:
        return string_filter(r, id, in, a, out);
    default: return jj_fail(r, PD_ERR_INVALID, "line %d: unknown filter", r->line);
    }
}
