// jinja_eval.c — renders a parsed template: statements write to an output buffer, expressions
// evaluate to jv values with Python/jinja2 semantics.
//
// Scopes: a chain of frames. The root frame holds template-level `set`s and shadows the context
// object, which shadows the globals (range, namespace, dict, raise_exception, strftime_now). A
// `for` body gets a frame that is cleared at every iteration (jinja2 gives each iteration fresh
// locals, so a `set` inside a loop is gone at the next iteration and after the loop; use a
// namespace to carry state). `if` bodies share their parent's frame. Macros run in a frame whose
// parent is the root frame (they see their arguments and template-level names).
//
// Undefined follows jinja2's default Undefined: printing gives "", truth is false, iteration is
// empty, `is defined` is false, `|default` replaces it; attribute/item access on it, arithmetic,
// ordering and calling it are errors ("'x' is undefined").
//
// Limits: every statement/expression evaluation costs a step, building strings costs a step per
// 32 bytes and lists a step per item, so max_steps bounds both time and the total memory a render
// can churn through; each string and the output are bounded by max_output_bytes; macro nesting by
// max_depth.
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "tok/jinja_impl.h"

typedef enum ex_rc { EX_OK = 0, EX_BREAK, EX_CONTINUE, EX_ERR } ex_rc;

pd_jinja_limits pd_jinja_limits_default(void) {
    pd_jinja_limits l = {
        .max_output_bytes = 16u << 20,
        .max_steps = 20000000,
        .max_items = 1000000,
        .max_depth = 64,
        .now_unix = 0,
    };
    return l;
}

static bool eval(jj_render *r, jj_frame *f, const jj_node *n, jv *out);
static ex_rc exec(jj_render *r, jj_frame *f, const jj_node *n);
static bool step(jj_render *r, uint64_t cost);

bool jj_step(jj_render *r, uint64_t cost) {
    r->n_steps += cost;
    if (r->n_steps <= r->lim.max_steps) return true;
    return jj_fail(r, PD_ERR_INVALID, "line %d: template exceeded %llu evaluation steps", r->line,
                   (unsigned long long)r->lim.max_steps);
}

static bool step(jj_render *r, uint64_t cost) { return jj_step(r, cost); }

// ---- frames ---------------------------------------------------------------------------------------
static jj_var *frame_find(jj_frame *f, const char *name) {
    for (size_t k = 0; k < f->n; k++)
        if (!strcmp(f->vars[k].name, name)) return &f->vars[k];
    return NULL;
}

// Binds name to val (ownership of val moves to the frame, even on failure).
static bool frame_set(jj_render *r, jj_frame *f, const char *name, jv val) {
    jj_var *v = frame_find(f, name);
    if (v) {
        jv_drop(&v->val);
        v->val = val;
        return true;
    }
    if (PD_ARRAY_RESERVE(f->vars, f->cap, f->n + 1) != PD_OK) {
        jv_drop(&val);
        return jj_fail_nomem(r);
    }
    f->vars[f->n].name = name;
    f->vars[f->n].val = val;
    f->n++;
    return true;
}

static void frame_clear(jj_frame *f) {
    for (size_t k = 0; k < f->n; k++) jv_drop(&f->vars[k].val);
    f->n = 0;
}

static void frame_fini(jj_frame *f) {
    frame_clear(f);
    pd_free(f->vars);
    f->vars = NULL;
    f->cap = 0;
}

static bool new_func(jj_render *r, int kind, int id, const jj_node *macro, const jv *self, jv *out) {
    jj_func *fn = pd_calloc(1, sizeof *fn);
    if (!fn) return jj_fail_nomem(r);
    fn->hdr.refcount = 1;
    fn->hdr.type = JV_FUNC;
    fn->kind = (uint8_t)kind;
    fn->id = id;
    fn->macro = macro;
    fn->self = self ? jv_copy(self) : jv_undef(NULL);
    *out = (jv){.kind = JV_FUNC};
    out->u.o = &fn->hdr;
    return true;
}

static bool lookup(jj_render *r, jj_frame *f, const char *name, jv *out) {
    for (jj_frame *fr = f; fr; fr = fr->parent) {
        jj_var *v = frame_find(fr, name);
        if (v) {
            *out = jv_copy(&v->val);
            return true;
        }
    }
    json_t *j = r->ctx ? json_object_get(r->ctx, name) : NULL;
    if (j) {
        *out = jv_from_json(j);
        return true;
    }
    int g = jj_global_lookup(name);
    if (g >= 0) return new_func(r, JJ_FUNC_GLOBAL, g, NULL, NULL, out);
    *out = jv_undef(name);
    return true;
}

static bool undefined_error(jj_render *r, const jv *v) {
    if (v->u.name) return jj_fail(r, PD_ERR_INVALID, "line %d: '%s' is undefined", r->line, v->u.name);
    return jj_fail(r, PD_ERR_INVALID, "line %d: value is undefined", r->line);
}

// ---- attribute and item access --------------------------------------------------------------------
static bool loop_attr(jj_render *r, const jv *obj, const char *name, jv *out) {
    const jj_loop *l = (const jj_loop *)obj->u.o;
    int64_t i0 = (int64_t)l->index0, len = (int64_t)l->length;
    if (!strcmp(name, "index")) *out = jv_int(i0 + 1);
    else if (!strcmp(name, "index0")) *out = jv_int(i0);
    else if (!strcmp(name, "revindex")) *out = jv_int(len - i0);
    else if (!strcmp(name, "revindex0")) *out = jv_int(len - i0 - 1);
    else if (!strcmp(name, "first")) *out = jv_bool(i0 == 0);
    else if (!strcmp(name, "last")) *out = jv_bool(i0 == len - 1);
    else if (!strcmp(name, "length")) *out = jv_int(len);
    else if (!strcmp(name, "depth")) *out = jv_int(l->depth);
    else if (!strcmp(name, "depth0")) *out = jv_int(l->depth - 1);
    else if (!strcmp(name, "previtem"))
        *out = i0 > 0 ? jv_from_json(json_array_get(l->items, (size_t)i0 - 1)) : jv_undef("previtem");
    else if (!strcmp(name, "nextitem"))
        *out = i0 + 1 < len ? jv_from_json(json_array_get(l->items, (size_t)i0 + 1)) : jv_undef("nextitem");
    else {
        int m = jj_method_lookup(obj, name);
        if (m >= 0) return new_func(r, JJ_FUNC_METHOD, m, NULL, obj, out);
        *out = jv_undef(name);
    }
    return true;
}

bool jj_getattr(jj_render *r, const jv *obj, const char *name, size_t len, jv *out) {
    switch (obj->kind) {
    case JV_UNDEF: return undefined_error(r, obj);
    case JV_LOOP: return loop_attr(r, obj, name, out);
    case JV_DICT: {
        int m = jj_method_lookup(obj, name);
        if (m >= 0) return new_func(r, JJ_FUNC_METHOD, m, NULL, obj, out);
        json_t *j = json_object_getn(obj->u.j, name, len);
        *out = j ? jv_from_json(j) : jv_undef(name);
        return true;
    }
    case JV_NS: {
        json_t *j = json_object_getn(obj->u.j, name, len);
        *out = j ? jv_from_json(j) : jv_undef(name);
        return true;
    }
    default: {
        int m = jj_method_lookup(obj, name);
        if (m >= 0) return new_func(r, JJ_FUNC_METHOD, m, NULL, obj, out);
        *out = jv_undef(name);
        return true;
    }
    }
}

// Python index normalization; false if out of range.
static bool norm_index(int64_t i, size_t n, size_t *out) {
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return false;
    *out = (size_t)i;
    return true;
}

bool jj_getitem(jj_render *r, const jv *obj, const jv *key, jv *out) {
    if (obj->kind == JV_UNDEF) return undefined_error(r, obj);
    bool int_key = key->kind == JV_INT || key->kind == JV_BOOL;
    int64_t ik = key->kind == JV_BOOL ? key->u.b : key->u.i;
    size_t idx;
    switch (obj->kind) {
    case JV_DICT: case JV_NS:
        if (key->kind == JV_STR) {
            json_t *j = json_object_getn(obj->u.j, jv_str_ptr(key), jv_str_len(key));
            if (j) {
                *out = jv_from_json(j);
                return true;
            }
            if (obj->kind == JV_DICT) return jj_getattr(r, obj, jv_str_ptr(key), jv_str_len(key), out);
        }
        break;
    case JV_LIST:
        if (int_key && norm_index(ik, json_array_size(obj->u.j), &idx)) {
            *out = jv_from_json(json_array_get(obj->u.j, idx));
            return true;
        }
        break;
    case JV_STR:
        if (int_key) {
            const char *s = jv_str_ptr(obj);
            size_t n = jv_str_len(obj);
            if (!norm_index(ik, jj_utf8_count(s, n), &idx)) break;
            size_t a = jj_utf8_offset(s, n, idx), b = a;
            jj_utf8_next(s, n, &b);
            return jj_str_new(r, s + a, b - a, out);
        }
        break;
    case JV_LOOP:
        if (key->kind == JV_STR) return loop_attr(r, obj, jv_str_ptr(key), out);
        break;
    default: break;
    }
    *out = jv_undef(key->kind == JV_STR ? jv_str_ptr(key) : NULL);
    return true;
}

bool jj_getpath(jj_render *r, const jv *obj, const jv *path, jv *out) {
    if (path->kind != JV_STR) return jj_getitem(r, obj, path, out);
    const char *s = jv_str_ptr(path);
    size_t n = jv_str_len(path), start = 0;
    jv cur = jv_copy(obj);
    for (;;) {
        size_t end = start;
        while (end < n && s[end] != '.') end++;
        jv key, next;
        bool digits = end > start;
        for (size_t k = start; k < end; k++) digits = digits && s[k] >= '0' && s[k] <= '9';
        if (digits && end - start < 18) {
            int64_t v = 0;
            for (size_t k = start; k < end; k++) v = v * 10 + (s[k] - '0');
            key = jv_int(v);
        } else if (!jj_str_new(r, s + start, end - start, &key)) {
            jv_drop(&cur);
            return false;
        }
        bool ok = jj_getitem(r, &cur, &key, &next);
        jv_drop(&key);
        jv_drop(&cur);
        if (!ok) return false;
        cur = next;
        if (end >= n) break;
        start = end + 1;
    }
    *out = cur;
    return true;
}

bool jj_iter_list(jj_render *r, const jv *v, json_t **out) {
    switch (v->kind) {
    case JV_UNDEF: *out = json_array(); break;
    case JV_LIST: *out = json_incref(v->u.j); return true;
    case JV_DICT: {
        json_t *arr = json_array();
        const char *key;
        size_t key_len;
        json_t *val;
        if (!arr) return jj_fail_nomem(r);
        json_object_keylen_foreach(v->u.j, key, key_len, val) {
            (void)val;
            if (json_array_append_new(arr, json_stringn_nocheck(key, key_len))) {
                json_decref(arr);
                return jj_fail_nomem(r);
            }
        }
        *out = arr;
        break;
    }
    case JV_STR: {
        const char *s = jv_str_ptr(v);
        size_t n = jv_str_len(v), i = 0;
        json_t *arr = json_array();
        if (!arr) return jj_fail_nomem(r);
        if (!step(r, jj_utf8_count(s, n))) {
            json_decref(arr);
            return false;
        }
        while (i < n) {
            size_t at = i;
            jj_utf8_next(s, n, &i);
            if (json_array_append_new(arr, json_stringn_nocheck(s + at, i - at))) {
                json_decref(arr);
                return jj_fail_nomem(r);
            }
        }
        *out = arr;
        break;
    }
    default:
        return jj_fail(r, PD_ERR_INVALID, "line %d: '%s' object is not iterable", r->line, jv_type_name(v));
    }
    return *out ? true : jj_fail_nomem(r);
}

// ---- arguments ------------------------------------------------------------------------------------
const jv *jj_arg(const jj_args *a, int idx, const char *name) {
    if (idx >= 0 && (size_t)idx < a->n_pos) return &a->pos[idx];
    for (size_t k = 0; name && k < a->n_kw; k++)
        if (!strcmp(a->kwnames[k], name)) return &a->kw[k];
    return NULL;
}

bool jj_args_check(jj_render *r, const jj_args *a, const char *what, size_t max_pos,
                   const char *const *names) {
    if (a->n_pos > max_pos)
        return jj_fail(r, PD_ERR_INVALID, "line %d: %s takes at most %zu positional argument(s), got %zu",
                       r->line, what, max_pos, a->n_pos);
    for (size_t k = 0; k < a->n_kw; k++) {
        bool known = false;
        for (size_t j = 0; names && names[j]; j++) known = known || !strcmp(names[j], a->kwnames[k]);
        if (!known)
            return jj_fail(r, PD_ERR_INVALID, "line %d: %s got an unexpected keyword argument '%s'",
                           r->line, what, a->kwnames[k]);
    }
    return true;
}

static void args_fini(jj_args *a) {
    for (size_t k = 0; k < a->n_pos; k++) jv_drop(&a->pos[k]);
    for (size_t k = 0; k < a->n_kw; k++) jv_drop(&a->kw[k]);
    pd_free(a->pos);
    a->pos = NULL;
    a->n_pos = a->n_kw = 0;
}

static bool eval_args(jj_render *r, jj_frame *f, const jj_node *n, jj_args *a) {
    size_t total = n->n_args + n->n_kwargs;
    memset(a, 0, sizeof *a);
    if (!total) return true;
    a->pos = pd_calloc(total, sizeof *a->pos);
    if (!a->pos) return jj_fail_nomem(r);
    a->kw = a->pos + n->n_args;
    a->kwnames = n->kwnames;
    for (size_t k = 0; k < n->n_args; k++, a->n_pos++)
        if (!eval(r, f, n->args[k], &a->pos[k])) return args_fini(a), false;
    for (size_t k = 0; k < n->n_kwargs; k++, a->n_kw++)
        if (!eval(r, f, n->kwargs[k], &a->kw[k])) return args_fini(a), false;
    return true;
}

// ---- output capture -------------------------------------------------------------------------------
// Runs body with its output going to a string.
static ex_rc capture(jj_render *r, jj_frame *f, const jj_node *body, jv *out) {
    jj_buf buf, *saved = r->out;
    jj_buf_init(&buf, r->lim.max_output_bytes);
    r->out = &buf;
    ex_rc rc = exec(r, f, body);
    r->out = saved;
    if (rc == EX_ERR) {
        jj_buf_fini(&buf);
        return EX_ERR;
    }
    if (!step(r, buf.s.len / 32) || !jj_str_from_buf(r, &buf, out)) {
        jj_buf_fini(&buf);
        return EX_ERR;
    }
    return rc;
}

// Applies a filter chain whose innermost input is `input` (block filters and `set x | f`).
static bool apply_chain(jj_render *r, jj_frame *f, const jj_node *chain, const jv *input, jv *out) {
    if (!chain) {
        *out = jv_copy(input);
        return true;
    }
    jv in;
    if (!apply_chain(r, f, chain->a, input, &in)) return false;
    jj_args args;
    if (!eval_args(r, f, chain, &args)) {
        jv_drop(&in);
        return false;
    }
    r->line = chain->line;
    bool ok = jj_filter_apply(r, chain->op, &in, &args, out);
    args_fini(&args);
    jv_drop(&in);
    return ok;
}

// ---- calls ----------------------------------------------------------------------------------------
static bool call_macro(jj_render *r, const jj_node *m, const jj_args *a, jv *out) {
    if (r->depth >= r->lim.max_depth)
        return jj_fail(r, PD_ERR_INVALID, "line %d: macro calls nested deeper than %d", r->line,
                       r->lim.max_depth);
    if (a->n_pos > m->n_kwargs)
        return jj_fail(r, PD_ERR_INVALID, "line %d: macro '%s' takes not more than %zu argument(s)",
                       r->line, m->str, m->n_kwargs);
    for (size_t k = 0; k < a->n_kw; k++) {
        bool known = false;
        for (size_t j = 0; j < m->n_kwargs; j++) known = known || !strcmp(m->kwnames[j], a->kwnames[k]);
        if (!known)
            return jj_fail(r, PD_ERR_INVALID, "line %d: macro '%s' takes no keyword argument '%s'",
                           r->line, m->str, a->kwnames[k]);
    }
    jj_frame mf = {.parent = r->root};
    bool ok = true;
    for (size_t j = 0; ok && j < m->n_kwargs; j++) {
        const jv *given = jj_arg(a, j < a->n_pos ? (int)j : -1, m->kwnames[j]);
        jv val;
        if (given) val = jv_copy(given);
        else if (m->kwargs[j]) ok = eval(r, &mf, m->kwargs[j], &val);
        else val = jv_undef(m->kwnames[j]);
        ok = ok && frame_set(r, &mf, m->kwnames[j], val);
    }
    if (ok) {
        r->depth++;
        ok = capture(r, &mf, m->a, out) != EX_ERR;
        r->depth--;
    }
    frame_fini(&mf);
    return ok;
}

static bool call_range(jj_render *r, const jj_args *a, jv *out) {
    int64_t v[3] = {0, 0, 1};
    if (a->n_pos < 1 || a->n_pos > 3 || a->n_kw)
        return jj_fail(r, PD_ERR_INVALID, "line %d: range expected 1 to 3 integer arguments", r->line);
    for (size_t k = 0; k < a->n_pos; k++) {
        if (a->pos[k].kind != JV_INT && a->pos[k].kind != JV_BOOL)
            return jj_fail(r, PD_ERR_INVALID, "line %d: '%s' object cannot be interpreted as an integer",
                           r->line, jv_type_name(&a->pos[k]));
        v[a->n_pos == 1 ? 1 : k] = a->pos[k].kind == JV_BOOL ? a->pos[k].u.b : a->pos[k].u.i;
    }
    if (v[2] == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: range() arg 3 must not be zero", r->line);
    double count = ceil(((double)v[1] - (double)v[0]) / (double)v[2]);
    if (count < 0) count = 0;
    if (count > (double)r->lim.max_items)
        return jj_fail(r, PD_ERR_INVALID, "line %d: range of %.0f items exceeds the limit of %zu",
                       r->line, count, r->lim.max_items);
    if (!step(r, (uint64_t)count)) return false;
    json_t *arr = json_array();
    if (!arr) return jj_fail_nomem(r);
    for (int64_t i = 0; i < (int64_t)count; i++) {
        if (json_array_append_new(arr, json_integer(v[0] + i * v[2]))) {
            json_decref(arr);
            return jj_fail_nomem(r);
        }
    }
    *out = jv_take_json(arr);
    return true;
}

// namespace(...) and dict(...): keyword arguments (and for dict/namespace a positional mapping).
static bool call_mapping(jj_render *r, const jj_args *a, bool is_ns, jv *out) {
    if (a->n_pos > 1 || (a->n_pos == 1 && a->pos[0].kind != JV_DICT))
        return jj_fail(r, PD_ERR_INVALID, "line %d: %s() takes keyword arguments or one mapping",
                       r->line, is_ns ? "namespace" : "dict");
    json_t *obj = a->n_pos ? json_copy(a->pos[0].u.j) : json_object();
    if (!obj) return jj_fail_nomem(r);
    for (size_t k = 0; k < a->n_kw; k++) {
        if (json_object_set_new(obj, a->kwnames[k], jv_to_json(&a->kw[k]))) {
            json_decref(obj);
            return jj_fail_nomem(r);
        }
    }
    *out = (jv){.kind = is_ns ? JV_NS : JV_DICT};
    out->u.j = obj;
    return true;
}

static bool call_strftime(jj_render *r, const jj_args *a, jv *out) {
    const jv *fmt = jj_arg(a, 0, "format");
    if (!fmt || fmt->kind != JV_STR || a->n_pos + a->n_kw != 1)
        return jj_fail(r, PD_ERR_INVALID, "line %d: strftime_now expects one format string", r->line);
    struct tm tm;
    time_t now = r->lim.now_unix ? (time_t)r->lim.now_unix : time(NULL);
    if (r->lim.now_unix) gmtime_r(&now, &tm);
    else localtime_r(&now, &tm);
    char buf[512];
    size_t n = jv_str_len(fmt) < 256 ? strftime(buf, sizeof buf, jv_str_ptr(fmt), &tm) : 0;
    return jj_str_new(r, buf, n, out);
}

enum { JJ_G_RANGE = 0, JJ_G_NAMESPACE, JJ_G_DICT, JJ_G_RAISE, JJ_G_STRFTIME };

int jj_global_lookup(const char *name) {
    static const char *const names[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
    for (size_t k = 0; k < PD_ARRAY_LEN(names); k++)
        if (!strcmp(names[k], name)) return (int)k;
    return -1;
}

static bool call_global(jj_render *r, int id, const jj_args *a, jv *out) {
    switch (id) {
    case JJ_G_RANGE: return call_range(r, a, out);
    case JJ_G_NAMESPACE: return call_mapping(r, a, true, out);
    case JJ_G_DICT: return call_mapping(r, a, false, out);
    case JJ_G_STRFTIME: return call_strftime(r, a, out);
    case JJ_G_RAISE: {
        // NOTE(jinja): the message is the error, verbatim (transformers raises TemplateError(msg)).
        const jv *msg = jj_arg(a, 0, "message");
        jj_buf b;
        jj_buf_init(&b, 4096);
        if (msg) jj_write_str(r, &b, msg);
        if (r->status == PD_OK) jj_fail(r, PD_ERR_INVALID, "%s", b.s.p ? b.s.p : "");
        jj_buf_fini(&b);
        return false;
    }
    default: return jj_fail(r, PD_ERR_INVALID, "line %d: unknown function", r->line);
    }
}

bool jj_call_value(jj_render *r, const jv *fn, const jj_args *args, jv *out) {
    if (fn->kind == JV_UNDEF) return undefined_error(r, fn);
    if (fn->kind != JV_FUNC)
        return jj_fail(r, PD_ERR_INVALID, "line %d: '%s' object is not callable", r->line, jv_type_name(fn));
    const jj_func *f = (const jj_func *)fn->u.o;
    if (!step(r, 1)) return false;
    switch (f->kind) {
    case JJ_FUNC_GLOBAL: return call_global(r, f->id, args, out);
    case JJ_FUNC_MACRO: return call_macro(r, f->macro, args, out);
    default: return jj_method_call(r, f->id, &f->self, args, out);
    }
}

// ---- operators ------------------------------------------------------------------------------------
static bool type_error(jj_render *r, const char *op, const jv *a, const jv *b) {
    if (a->kind == JV_UNDEF) return undefined_error(r, a);
    if (b && b->kind == JV_UNDEF) return undefined_error(r, b);
    if (!b)
        return jj_fail(r, PD_ERR_INVALID, "line %d: bad operand type for unary %s: '%s'", r->line, op,
                       jv_type_name(a));
    return jj_fail(r, PD_ERR_INVALID, "line %d: unsupported operand type(s) for %s: '%s' and '%s'",
                   r->line, op, jv_type_name(a), jv_type_name(b));
}

static int64_t as_int(const jv *v) { return v->kind == JV_BOOL ? v->u.b : v->u.i; }

static bool repeat(jj_render *r, const jv *seq, int64_t times, jv *out) {
    if (times < 0) times = 0;
    if (seq->kind == JV_STR) {
        size_t n = jv_str_len(seq);
        if (n && (uint64_t)times > r->lim.max_output_bytes / n)
            return jj_fail(r, PD_ERR_INVALID, "line %d: string repetition exceeds the limit of %zu bytes",
                           r->line, r->lim.max_output_bytes);
        jj_buf b;
        jj_buf_init(&b, r->lim.max_output_bytes);
        for (int64_t k = 0; k < times; k++)
            if (!jj_buf_put(&b, jv_str_ptr(seq), n)) break;
        return step(r, b.s.len / 32) && jj_str_from_buf(r, &b, out);
    }
    size_t n = json_array_size(seq->u.j);
    if (n && (uint64_t)times > r->lim.max_items / n)
        return jj_fail(r, PD_ERR_INVALID, "line %d: list repetition exceeds the limit of %zu items",
                       r->line, r->lim.max_items);
    if (!step(r, n * (uint64_t)times)) return false;
    json_t *arr = json_array();
    for (int64_t k = 0; arr && k < times; k++)
        if (json_array_extend(arr, seq->u.j)) { json_decref(arr); arr = NULL; }
    if (!arr) return jj_fail_nomem(r);
    *out = jv_take_json(arr);
    return true;
}

static bool concat_seq(jj_render *r, const jv *a, const jv *b, jv *out) {
    if (a->kind == JV_STR) {
        jj_buf buf;
        jj_buf_init(&buf, r->lim.max_output_bytes);
        jj_buf_put(&buf, jv_str_ptr(a), jv_str_len(a));
        jj_buf_put(&buf, jv_str_ptr(b), jv_str_len(b));
        return step(r, buf.s.len / 32) && jj_str_from_buf(r, &buf, out);
    }
    size_t n = json_array_size(a->u.j) + json_array_size(b->u.j);
    if (n > r->lim.max_items)
        return jj_fail(r, PD_ERR_INVALID, "line %d: list exceeds the limit of %zu items", r->line, r->lim.max_items);
    if (!step(r, n)) return false;
    json_t *arr = json_copy(a->u.j);
    if (!arr || json_array_extend(arr, b->u.j)) {
        json_decref(arr);
        return jj_fail_nomem(r);
    }
    *out = jv_take_json(arr);
    return true;
}

static bool int_arith(jj_render *r, int op, int64_t x, int64_t y, jv *out) {
    int64_t z = 0;
    bool overflow = false;
    switch (op) {
    case JJ_OP_ADD: overflow = __builtin_add_overflow(x, y, &z); break;
    case JJ_OP_SUB: overflow = __builtin_sub_overflow(x, y, &z); break;
    case JJ_OP_MUL: overflow = __builtin_mul_overflow(x, y, &z); break;
    case JJ_OP_FLOORDIV: case JJ_OP_MOD:
        if (y == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: integer division or modulo by zero", r->line);
        if (x == INT64_MIN && y == -1) { overflow = op == JJ_OP_FLOORDIV; z = 0; break; }
        z = op == JJ_OP_FLOORDIV ? x / y : x % y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) z = op == JJ_OP_FLOORDIV ? z - 1 : z + y;
        break;
    case JJ_OP_POW: {
        if (y < 0) {
            *out = jv_float(pow((double)x, (double)y));
            return true;
        }
        // Squaring by halves: once a needed square overflows, so does the result (|x| >= 2).
        int64_t base = x;
        z = 1;
        while (y > 0 && !overflow) {
            if (y & 1) overflow = __builtin_mul_overflow(z, base, &z);
            y >>= 1;
            if (y && !overflow) overflow = __builtin_mul_overflow(base, base, &base);
        }
        break;
    }
    default: break;
    }
    if (overflow) return jj_fail(r, PD_ERR_INVALID, "line %d: integer overflow", r->line);
    *out = jv_int(z);
    return true;
}

static bool float_arith(jj_render *r, int op, double x, double y, jv *out) {
    double z = 0;
    switch (op) {
    case JJ_OP_ADD: z = x + y; break;
    case JJ_OP_SUB: z = x - y; break;
    case JJ_OP_MUL: z = x * y; break;
    case JJ_OP_DIV: case JJ_OP_FLOORDIV: case JJ_OP_MOD:
        if (y == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: division by zero", r->line);
        if (op == JJ_OP_DIV) z = x / y;
        else if (op == JJ_OP_FLOORDIV) z = floor(x / y);
        else {
            z = fmod(x, y);
            if (z != 0 && ((z < 0) != (y < 0))) z += y;
        }
        break;
    case JJ_OP_POW: z = pow(x, y); break;
    default: break;
    }
    *out = jv_float(z);
    return true;
}

static bool binop(jj_render *r, int op, const jv *a, const jv *b, jv *out) {
    static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT && op != JJ_OP_DIV)
            return int_arith(r, op, as_int(a), as_int(b), out);
        return float_arith(r, op, jv_as_double(a), jv_as_double(b), out);
    }
    if (op == JJ_OP_ADD && a->kind == b->kind && (a->kind == JV_STR || a->kind == JV_LIST))
        return concat_seq(r, a, b, out);
    if (op == JJ_OP_MOD && a->kind == JV_STR && b->kind != JV_UNDEF) return jj_percent_format(r, a, b, out);
    if (op == JJ_OP_MUL) {
        if ((a->kind == JV_STR || a->kind == JV_LIST) && (b->kind == JV_INT || b->kind == JV_BOOL))
            return repeat(r, a, as_int(b), out);
        if ((b->kind == JV_STR || b->kind == JV_LIST) && (a->kind == JV_INT || a->kind == JV_BOOL))
            return repeat(r, b, as_int(a), out);
    }
    if (op == JJ_OP_ADD && a->kind == JV_STR && b->kind != JV_UNDEF)
        return jj_fail(r, PD_ERR_INVALID, "line %d: can only concatenate str (not \"%s\") to str", r->line,
                       jv_type_name(b));
    return type_error(r, names[op], a, b);
}

static bool contains(jj_render *r, const jv *container, const jv *item, bool *out) {
    switch (container->kind) {
    case JV_UNDEF: *out = false; return true;
    case JV_STR: {
        if (item->kind != JV_STR)
            return jj_fail(r, PD_ERR_INVALID, "line %d: 'in <string>' requires string as left operand, not %s",
                           r->line, jv_type_name(item));
        size_t hn = jv_str_len(container), nn = jv_str_len(item);
        *out = nn == 0 || (nn <= hn && memmem(jv_str_ptr(container), hn, jv_str_ptr(item), nn) != NULL);
        return true;
    }
    case JV_LIST:
        *out = false;
        for (size_t k = 0; k < json_array_size(container->u.j) && !*out; k++) {
            jv e = jv_from_json(json_array_get(container->u.j, k));
            *out = jj_equal(&e, item, 0);
            jv_drop(&e);
        }
        return true;
    case JV_DICT: case JV_NS:
        *out = item->kind == JV_STR && json_object_getn(container->u.j, jv_str_ptr(item), jv_str_len(item));
        return true;
    default:
        return jj_fail(r, PD_ERR_INVALID, "line %d: argument of type '%s' is not iterable", r->line,
                       jv_type_name(container));
    }
}

static bool compare_one(jj_render *r, int op, const jv *a, const jv *b, bool *out) {
    int c;
    switch (op) {
    case JJ_CMP_EQ: *out = jj_equal(a, b, 0); return true;
    case JJ_CMP_NE: *out = !jj_equal(a, b, 0); return true;
    case JJ_CMP_IN: return contains(r, b, a, out);
    case JJ_CMP_NOTIN: if (!contains(r, b, a, out)) return false; *out = !*out; return true;
    default: break;
    }
    if (a->kind == JV_UNDEF) return undefined_error(r, a);
    if (b->kind == JV_UNDEF) return undefined_error(r, b);
    if (!jj_compare(r, a, b, &c)) return false;
    *out = op == JJ_CMP_LT ? c < 0 : op == JJ_CMP_LE ? c <= 0 : op == JJ_CMP_GT ? c > 0 : c >= 0;
    return true;
}

// ---- expressions ----------------------------------------------------------------------------------
static bool eval_slice_bound(jj_render *r, jj_frame *f, const jj_node *n, bool *given, int64_t *v) {
    *given = false;
    if (!n) return true;
    jv x;
    if (!eval(r, f, n, &x)) return false;
    if (x.kind == JV_NONE) return true;
    if (x.kind != JV_INT && x.kind != JV_BOOL) {
        jv_drop(&x);
        return jj_fail(r, PD_ERR_INVALID, "line %d: slice indices must be integers or None", r->line);
    }
    *given = true;
    *v = as_int(&x);
    return true;
}

static bool eval_slice(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    bool has[3];
    int64_t v[3] = {0, 0, 1};
    if (!eval_slice_bound(r, f, n->b, &has[0], &v[0]) || !eval_slice_bound(r, f, n->c, &has[1], &v[1]) ||
        !eval_slice_bound(r, f, n->d, &has[2], &v[2]))
        return false;
    if (has[2] && v[2] == 0) return jj_fail(r, PD_ERR_INVALID, "line %d: slice step cannot be zero", r->line);
    int64_t st = has[2] ? v[2] : 1;
    jv obj;
    if (!eval(r, f, n->a, &obj)) return false;
    if (obj.kind != JV_STR && obj.kind != JV_LIST) {
        bool ok = obj.kind == JV_UNDEF ? undefined_error(r, &obj)
                                       : jj_fail(r, PD_ERR_INVALID, "line %d: '%s' object is not subscriptable",
                                                 r->line, jv_type_name(&obj));
        jv_drop(&obj);
        return ok;
    }
    const char *s = obj.kind == JV_STR ? jv_str_ptr(&obj) : NULL;
    size_t sn = s ? jv_str_len(&obj) : 0;
    int64_t len = (int64_t)(s ? jj_utf8_count(s, sn) : json_array_size(obj.u.j));
    // Python's PySlice_AdjustIndices.
    int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? len - 1 : len;
    int64_t start = has[0] ? v[0] : (st < 0 ? hi : lo), stop = has[1] ? v[1] : (st < 0 ? lo : hi);
    if (has[0]) { if (start < 0) start += len; start = start < lo ? lo : start > hi ? hi : start; }
    if (has[1]) { if (stop < 0) stop += len; stop = stop < lo ? lo : stop > hi ? hi : stop; }
    bool ok = true;
    if (s) {
        jj_buf b;
        jj_buf_init(&b, r->lim.max_output_bytes);
        if (st == 1 && start < stop) {
            size_t a0 = jj_utf8_offset(s, sn, (size_t)start);
            size_t a1 = a0 + jj_utf8_offset(s + a0, sn - a0, (size_t)(stop - start));
            ok = jj_str_new(r, s + a0, a1 - a0, out);
        } else {
            for (int64_t i = start; st > 0 ? i < stop : i > stop; i += st) {
                size_t a0 = jj_utf8_offset(s, sn, (size_t)i), a1 = a0;
                jj_utf8_next(s, sn, &a1);
                jj_buf_put(&b, s + a0, a1 - a0);
            }
            ok = step(r, (uint64_t)len) && jj_str_from_buf(r, &b, out);
        }
        jj_buf_fini(&b);
    } else {
        json_t *arr = json_array();
        ok = arr && step(r, (uint64_t)len);
        for (int64_t i = start; ok && (st > 0 ? i < stop : i > stop); i += st)
            ok = !json_array_append(arr, json_array_get(obj.u.j, (size_t)i));
        if (ok) *out = jv_take_json(arr);
        else {
            json_decref(arr);
            if (r->status == PD_OK) jj_fail_nomem(r);
        }
    }
    jv_drop(&obj);
    return ok;
}

static bool eval_seq(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    if (!step(r, n->n_args)) return false;
    json_t *arr = json_array();
    if (!arr) return jj_fail_nomem(r);
    for (size_t k = 0; k < n->n_args; k++) {
        jv e;
        if (!eval(r, f, n->args[k], &e)) {
            json_decref(arr);
            return false;
        }
        int rc = json_array_append_new(arr, jv_to_json(&e));
        jv_drop(&e);
        if (rc) {
            json_decref(arr);
            return jj_fail_nomem(r);
        }
    }
    *out = jv_take_json(arr);
    return true;
}

static bool eval_dict(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    json_t *obj = json_object();
    if (!obj) return jj_fail_nomem(r);
    for (size_t k = 0; k < n->n_args; k++) {
        jv key, val;
        if (!eval(r, f, n->args[k], &key)) goto fail;
        jj_buf kb;
        jj_buf_init(&kb, r->lim.max_output_bytes);
        bool ok = jj_write_str(r, &kb, &key);
        jv_drop(&key);
        if (!ok || !eval(r, f, n->kwargs[k], &val)) {
            jj_buf_fini(&kb);
            goto fail;
        }
        int rc = json_object_setn_new_nocheck(obj, kb.s.p ? kb.s.p : "", kb.s.len, jv_to_json(&val));
        jv_drop(&val);
        jj_buf_fini(&kb);
        if (rc) {
            jj_fail_nomem(r);
            goto fail;
        }
    }
    *out = jv_take_json(obj);
    return true;
fail:
    json_decref(obj);
    return false;
}

static bool eval_concat(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    jj_buf b;
    jj_buf_init(&b, r->lim.max_output_bytes);
    for (size_t k = 0; k < n->n_args; k++) {
        jv e;
        if (!eval(r, f, n->args[k], &e)) {
            jj_buf_fini(&b);
            return false;
        }
        bool ok = jj_write_str(r, &b, &e);
        jv_drop(&e);
        if (!ok) {
            jj_buf_fini(&b);
            return false;
        }
    }
    if (!step(r, b.s.len / 32)) {
        jj_buf_fini(&b);
        return false;
    }
    return jj_str_from_buf(r, &b, out);
}

static bool eval_compare(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    jv left;
    if (!eval(r, f, n->a, &left)) return false;
    bool result = true;
    for (size_t k = 0; k < n->n_args && result; k++) {
        jv right;
        if (!eval(r, f, n->args[k], &right)) {
            jv_drop(&left);
            return false;
        }
        r->line = n->line;
        bool ok = compare_one(r, n->ops[k], &left, &right, &result);
        jv_drop(&left);
        left = right;
        if (!ok) {
            jv_drop(&left);
            return false;
        }
    }
    jv_drop(&left);
    *out = jv_bool(result);
    return true;
}

static bool eval_call_like(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    jv target = jv_undef(NULL);
    if (n->a && !eval(r, f, n->a, &target)) return false;
    jj_args args;
    if (!eval_args(r, f, n, &args)) {
        jv_drop(&target);
        return false;
    }
    r->line = n->line;
    bool ok;
    if (n->kind == JJ_E_CALL) {
        ok = jj_call_value(r, &target, &args, out);
    } else if (n->kind == JJ_E_FILTER) {
        ok = jj_filter_apply(r, n->op, &target, &args, out);
    } else {
        bool b = false;
        ok = jj_test_apply(r, n->op, &target, &args, &b);
        if (ok) *out = jv_bool(b);
    }
    args_fini(&args);
    jv_drop(&target);
    return ok;
}

static bool eval_unary(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    jv x;
    if (!eval(r, f, n->a, &x)) return false;
    r->line = n->line;
    bool ok = true;
    if (n->kind == JJ_E_NOT) *out = jv_bool(!jv_truthy(&x));
    else if (x.kind == JV_FLOAT) *out = jv_float(n->kind == JJ_E_NEG ? -x.u.f : x.u.f);
    else if (x.kind == JV_INT || x.kind == JV_BOOL) {
        int64_t v = as_int(&x);
        if (n->kind == JJ_E_NEG && v == INT64_MIN) ok = jj_fail(r, PD_ERR_INVALID, "line %d: integer overflow", r->line);
        else *out = jv_int(n->kind == JJ_E_NEG ? -v : v);
    } else ok = type_error(r, n->kind == JJ_E_NEG ? "-" : "+", &x, NULL);
    jv_drop(&x);
    return ok;
}

static bool eval_binary(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    jv a, b;
    if (!eval(r, f, n->a, &a)) return false;
    if (n->kind == JJ_E_AND || n->kind == JJ_E_OR) {
        if (jv_truthy(&a) == (n->kind == JJ_E_OR)) {
            *out = a;
            return true;
        }
        jv_drop(&a);
        return eval(r, f, n->b, out);
    }
    if (!eval(r, f, n->b, &b)) {
        jv_drop(&a);
        return false;
    }
    r->line = n->line;
    bool ok = binop(r, n->op, &a, &b, out);
    jv_drop(&a);
    jv_drop(&b);
    return ok;
}

static bool eval(jj_render *r, jj_frame *f, const jj_node *n, jv *out) {
    r->line = n->line;
    if (!step(r, 1)) return false;
    switch (n->kind) {
    case JJ_E_CONST:
        *out = n->value;
        out->is_borrowed = n->value.kind == JV_STR;
        return true;
    case JJ_E_NAME: return lookup(r, f, n->str, out);
    case JJ_E_ATTR: {
        jv obj;
        if (!eval(r, f, n->a, &obj)) return false;
        r->line = n->line;
        bool ok = jj_getattr(r, &obj, n->str, n->len, out);
        jv_drop(&obj);
        return ok;
    }
    case JJ_E_ITEM: {
        jv obj, key;
        if (!eval(r, f, n->a, &obj)) return false;
        if (!eval(r, f, n->b, &key)) {
            jv_drop(&obj);
            return false;
        }
        r->line = n->line;
        bool ok = jj_getitem(r, &obj, &key, out);
        jv_drop(&obj);
        jv_drop(&key);
        return ok;
    }
    case JJ_E_SLICE: return eval_slice(r, f, n, out);
    case JJ_E_CALL: case JJ_E_FILTER: case JJ_E_TEST: return eval_call_like(r, f, n, out);
    case JJ_E_BIN: case JJ_E_AND: case JJ_E_OR: return eval_binary(r, f, n, out);
    case JJ_E_NEG: case JJ_E_POS: case JJ_E_NOT: return eval_unary(r, f, n, out);
    case JJ_E_COND: {
        jv c;
        if (!eval(r, f, n->a, &c)) return false;
        bool t = jv_truthy(&c);
        jv_drop(&c);
        if (t) return eval(r, f, n->b, out);
        if (n->c) return eval(r, f, n->c, out);
        *out = jv_undef(NULL);
        return true;
    }
    case JJ_E_COMPARE: return eval_compare(r, f, n, out);
    case JJ_E_LIST: case JJ_E_TUPLE: return eval_seq(r, f, n, out);
    case JJ_E_DICT: return eval_dict(r, f, n, out);
    case JJ_E_CONCAT: return eval_concat(r, f, n, out);
    default: return jj_fail(r, PD_ERR_INVALID, "line %d: cannot evaluate this expression", n->line);
    }
}

// ---- statements -----------------------------------------------------------------------------------
// Binds the targets of a for loop or a tuple assignment (names[0..n)) to val.
static bool assign_names(jj_render *r, jj_frame *f, jj_node *const *names, size_t n, bool unpack,
                         const jv *val) {
    if (!unpack) return frame_set(r, f, names[0]->str, jv_copy(val));
    if (val->kind != JV_LIST)
        return jj_fail(r, PD_ERR_INVALID, "line %d: cannot unpack non-sequence %s", r->line, jv_type_name(val));
    size_t have = json_array_size(val->u.j);
    if (have != n)
        return jj_fail(r, PD_ERR_INVALID, "line %d: %s values to unpack (expected %zu, got %zu)", r->line,
                       have > n ? "too many" : "not enough", n, have);
    for (size_t k = 0; k < n; k++)
        if (!frame_set(r, f, names[k]->str, jv_from_json(json_array_get(val->u.j, k)))) return false;
    return true;
}

static bool assign(jj_render *r, jj_frame *f, const jj_node *target, jv val) {
    bool ok;
    if (target->kind == JJ_E_NAME) return frame_set(r, f, target->str, val);
    if (target->kind == JJ_E_TUPLE) {
        ok = assign_names(r, f, target->args, target->n_args, true, &val);
        jv_drop(&val);
        return ok;
    }
    // ns.attr = val
    jv ns;
    if (!lookup(r, f, target->a->str, &ns)) {
        jv_drop(&val);
        return false;
    }
    if (ns.kind != JV_NS) {
        ok = jj_fail(r, PD_ERR_INVALID, "line %d: cannot assign attribute on non-namespace object", r->line);
    } else {
        json_t *j = jv_to_json(&val);
        ok = j && !json_object_setn_new_nocheck(ns.u.j, target->str, target->len, j);
        if (!ok) jj_fail_nomem(r);
    }
    jv_drop(&ns);
    jv_drop(&val);
    return ok;
}

// The items a for loop visits: the iterable, minus those failing the `if` filter.
static bool for_items(jj_render *r, jj_frame *lf, const jj_node *n, const jv *iter, json_t **out) {
    json_t *all;
    if (!jj_iter_list(r, iter, &all)) return false;
    if (!n->d) {
        *out = all;
        return true;
    }
    json_t *kept = json_array();
    bool ok = kept != NULL;
    if (!ok) jj_fail_nomem(r);
    for (size_t k = 0; ok && k < json_array_size(all); k++) {
        jv item = jv_from_json(json_array_get(all, k)), c = jv_undef(NULL);
        frame_clear(lf);
        ok = assign_names(r, lf, n->args, n->n_args, n->n_args > 1, &item) && eval(r, lf, n->d, &c);
        if (ok && jv_truthy(&c) && json_array_append(kept, json_array_get(all, k))) ok = jj_fail_nomem(r);
        jv_drop(&c);
        jv_drop(&item);
    }
    frame_clear(lf);
    json_decref(all);
    if (!ok) json_decref(kept);
    else *out = kept;
    return ok;
}

static ex_rc exec_for(jj_render *r, jj_frame *f, const jj_node *n) {
    jv iter;
    if (!eval(r, f, n->a, &iter)) return EX_ERR;
    jj_frame lf = {.parent = f};
    json_t *items = NULL;
    bool ok = for_items(r, &lf, n, &iter, &items);
    jv_drop(&iter);
    if (!ok) {
        frame_fini(&lf);
        return EX_ERR;
    }
    size_t len = json_array_size(items);
    jv loop = jv_undef(NULL);
    jj_loop *l = NULL;
    if (n->uses_loop && len) {
        l = pd_calloc(1, sizeof *l);
        if (!l) {
            json_decref(items);
            frame_fini(&lf);
            jj_fail_nomem(r);
            return EX_ERR;
        }
        l->hdr.refcount = 1;
        l->hdr.type = JV_LOOP;
        l->items = json_incref(items);
        l->length = len;
        l->depth = 1;
        loop.kind = JV_LOOP;
        loop.u.o = &l->hdr;
    }
    ex_rc rc = EX_OK;
    for (size_t k = 0; k < len; k++) {
        r->line = n->line;
        if (!step(r, 1)) { rc = EX_ERR; break; }
        jv item = jv_from_json(json_array_get(items, k));
        frame_clear(&lf);
        if (l) l->index0 = k;
        ok = assign_names(r, &lf, n->args, n->n_args, n->n_args > 1, &item) &&
             (!l || frame_set(r, &lf, "loop", jv_copy(&loop)));
        jv_drop(&item);
        rc = ok ? exec(r, &lf, n->b) : EX_ERR;
        if (rc == EX_BREAK) { rc = EX_OK; break; }
        if (rc == EX_CONTINUE) rc = EX_OK;
        if (rc == EX_ERR) break;
    }
    jv_drop(&loop);
    frame_fini(&lf);
    json_decref(items);
    if (rc == EX_OK && len == 0 && n->c) rc = exec(r, f, n->c);
    return rc;
}

static ex_rc exec_block_value(jj_render *r, jj_frame *f, const jj_node *n) {
    jv body, val;
    ex_rc rc = capture(r, f, n->kind == JJ_S_SET_BLOCK ? n->b : n->a, &body);
    if (rc == EX_ERR) return EX_ERR;
    bool ok = apply_chain(r, f, n->kind == JJ_S_SET_BLOCK ? n->c : n->b, &body, &val);
    jv_drop(&body);
    if (!ok) return EX_ERR;
    if (n->kind == JJ_S_SET_BLOCK) return assign(r, f, n->a, val) ? rc : EX_ERR;
    ok = jj_write_str(r, r->out, &val);
    jv_drop(&val);
    return ok ? rc : EX_ERR;
}

static ex_rc exec_with(jj_render *r, jj_frame *f, const jj_node *n) {
    jj_frame wf = {.parent = f};
    ex_rc rc = EX_OK;
    for (size_t k = 0; k < n->n_kwargs && rc == EX_OK; k++) {
        jv v;
        if (!eval(r, f, n->kwargs[k], &v) || !frame_set(r, &wf, n->kwnames[k], v)) rc = EX_ERR;
    }
    if (rc == EX_OK) rc = exec(r, &wf, n->a);
    frame_fini(&wf);
    return rc;
}

static ex_rc exec(jj_render *r, jj_frame *f, const jj_node *n) {
    r->line = n->line;
    if (!step(r, 1)) return EX_ERR;
    switch (n->kind) {
    case JJ_S_BODY:
        for (size_t k = 0; k < n->n_args; k++) {
            ex_rc rc = exec(r, f, n->args[k]);
            if (rc != EX_OK) return rc;
        }
        return EX_OK;
    case JJ_S_TEXT:
        return jj_buf_put(r->out, n->str, n->len) ? EX_OK : (jj_fail_buf(r, r->out), EX_ERR);
    case JJ_S_PRINT: {
        jv v;
        if (!eval(r, f, n->a, &v)) return EX_ERR;
        bool ok = jj_write_str(r, r->out, &v);
        jv_drop(&v);
        return ok ? EX_OK : EX_ERR;
    }
    case JJ_S_IF: {
        jv c;
        if (!eval(r, f, n->a, &c)) return EX_ERR;
        bool t = jv_truthy(&c);
        jv_drop(&c);
        if (t) return exec(r, f, n->b);
        return n->c ? exec(r, f, n->c) : EX_OK;
    }
    case JJ_S_FOR: return exec_for(r, f, n);
    case JJ_S_SET: {
        jv v;
        if (!eval(r, f, n->b, &v)) return EX_ERR;
        r->line = n->line;
        return assign(r, f, n->a, v) ? EX_OK : EX_ERR;
    }
    case JJ_S_SET_BLOCK: case JJ_S_FILTER: return exec_block_value(r, f, n);
    case JJ_S_MACRO: {
        jv m;
        if (!new_func(r, JJ_FUNC_MACRO, 0, n, NULL, &m)) return EX_ERR;
        return frame_set(r, f, n->str, m) ? EX_OK : EX_ERR;
    }
    case JJ_S_BREAK: return EX_BREAK;
    case JJ_S_CONTINUE: return EX_CONTINUE;
    case JJ_S_WITH: return exec_with(r, f, n);
    default:
        jj_fail(r, PD_ERR_INVALID, "line %d: cannot execute this statement", n->line);
        return EX_ERR;
    }
}

pd_status pd_jinja_render_ex(const pd_jinja_tmpl *t, json_t *context, const pd_jinja_limits *limits,
                             char **out, size_t *out_len, pd_err *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) return pd_err_set(err, PD_ERR_INVALID, "no template");
    if (context && !json_is_object(context))
        return pd_err_set(err, PD_ERR_INVALID, "template context must be a JSON object");
    jj_buf buf;
    jj_frame root = {0};
    jj_render r = {.tmpl = t, .ctx = context, .root = &root, .err = err, .status = PD_OK};
    r.lim = limits ? *limits : pd_jinja_limits_default();
    if (r.lim.max_depth < 1) r.lim.max_depth = 1;
    jj_buf_init(&buf, r.lim.max_output_bytes);
    r.out = &buf;
    ex_rc rc = exec(&r, &root, t->root);
    frame_fini(&root);
    if (rc == EX_ERR || r.status != PD_OK) {
        jj_buf_fini(&buf);
        if (r.status == PD_OK) return pd_err_set(err, PD_ERR_INVALID, "template render failed");
        return r.status;
    }
    *out = jj_buf_take(&buf, out_len);
    if (!*out) return pd_err_set(err, PD_ERR_NOMEM, "out of memory rendering template");
    return PD_OK;
}

pd_status pd_jinja_render(const pd_jinja_tmpl *t, json_t *context, char **out, size_t *out_len,
                          pd_err *err) {
    return pd_jinja_render_ex(t, context, NULL, out, out_len, err);
}
