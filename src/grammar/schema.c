// schema.c — JSON schema → GBNF (the supported subset is listed in grammar.h).
//
// Every schema node becomes a rule "<prefix>rN"; its body is built in a scratch buffer while the
// rules it needs are appended to the output first. $refs are memoised by pointer string (a rule id
// is assigned before its body is built, so recursive schemas work: a JSON value never starts with
// itself, so the grammar is never left-recursive). Object properties come in the schema's order;
// optional ones may be skipped, which takes two rule chains (before / after the first property
// written) to place the commas.
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "base/buf.h"
#include "grammar/grammar.h"

typedef struct sbuf {
    char *s;
    size_t len, cap;
    bool failed;
} sbuf;

static void sb_putn(sbuf *b, const char *s, size_t n) {
    if (b->failed) return;
    pd_buf pb = {b->s, b->len, b->cap};  // same invariant: cap >= len + 1 once allocated
    if (pd_buf_append(&pb, s, n)) {
        b->failed = true;
        return;
    }
    b->s = pb.p;
    b->len = pb.len;
    b->cap = pb.cap;
}
static void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }
static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof tmp) n = (int)sizeof tmp - 1;
    if (n > 0) sb_putn(b, tmp, (size_t)n);
}

pd_status pd_grammar_append_literal(const char *s, size_t n, char **buf, size_t *len, size_t *cap) {
    sbuf b = {*buf, *len, *cap, false};
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[3] = {'\\', (char)c, 0};
            sb_puts(&b, e);
        } else if (c < 0x20 || c == 0x7f) {
            sb_printf(&b, "\\x%02X", c);
        } else {
            sb_putn(&b, (const char *)&c, 1);
        }
    }
    *buf = b.s;
    *len = b.len;
    *cap = b.cap;
    return b.failed ? PD_ERR_NOMEM : PD_OK;
}

// The JSON primitives, each rule name prefixed. $ is the prefix.
static const char *k_prims =
    "$ws ::= ( \" \" | \"\\n\" \" \"{0,16} )?\n"
    "$value ::= $object | $array | $string | $number | \"true\" | \"false\" | \"null\"\n"
    "$object ::= \"{\" $ws ( $kv ( \",\" $ws $kv )* )? \"}\"\n"
    "$kv ::= $string $ws \":\" $ws $value $ws\n"
    "$array ::= \"[\" $ws ( $value $ws ( \",\" $ws $value $ws )* )? \"]\"\n"
    "$string ::= \"\\\"\" $char* \"\\\"\"\n"
    "$char ::= [^\"\\\\\\x00-\\x1F\\x7F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" $hex $hex $hex $hex )\n"
    "$hex ::= [0-9a-fA-F]\n"
    "$number ::= \"-\"? $uint ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )?\n"
    "$integer ::= \"-\"? $uint\n"
    "$uint ::= \"0\" | [1-9] [0-9]{0,15}\n"
    "$date ::= [0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )\n"
    "$time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? "
    "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n"
    "$date-time ::= $date \"T\" $time\n"
    "$uuid ::= $hex{8} \"-\" $hex{4} \"-\" $hex{4} \"-\" $hex{4} \"-\" $hex{12}\n"
    "$email ::= [a-zA-Z0-9_+-]{1,32} ( \".\" [a-zA-Z0-9_+-]{1,32} ){0,3} \"@\" "
    "( [a-zA-Z0-9] [a-zA-Z0-9-]{0,30} \".\" ){1,3} [a-zA-Z]{2,8}\n";

// k_prims with every '$' replaced by prefix.
static void expand_prims(char *out, size_t n, const char *prefix) {
    size_t k = 0, pl = strlen(prefix);
    for (const char *c = k_prims; *c && k + pl + 1 < n; c++) {
        if (*c == '$') {
            memcpy(out + k, prefix, pl);
            k += pl;
        } else {
            out[k++] = *c;
        }
    }
    out[k] = 0;
}

typedef struct memo {
    char *ref;
    int id;
} memo;

typedef struct sc {
    sbuf out;
    const json_t *root;
    const char *prefix;
    pd_err *err;
    bool failed;
    int n_rules;
    memo *refs;
    int n_refs;
    size_t cap_refs;
    int depth;
} sc;

static int fail(sc *c, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(sc *c, const char *path, const char *fmt, ...) {
    if (c->failed) return -1;
    c->failed = true;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pd_err_set(c->err, PD_ERR_INVALID, "%s (at %s)", msg, path[0] ? path : "the schema root");
    return -1;
}

static void emit_rule(sc *c, int id, sbuf *body) {
    sb_printf(&c->out, "%sr%d ::= ", c->prefix, id);
    sb_putn(&c->out, body->s ? body->s : "", body->len);
    sb_puts(&c->out, "\n");
    if (body->failed) c->out.failed = true;
    pd_free(body->s);
}

static void lit(sbuf *b, const char *s, size_t n) {
    sb_puts(b, "\"");
    pd_grammar_append_literal(s, n, &b->s, &b->len, &b->cap) == PD_OK ? (void)0 : (void)(b->failed = true);
    sb_puts(b, "\"");
}

static void json_lit(sc *c, sbuf *b, const json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) {
        b->failed = true;
        return;
    }
    lit(b, s, strlen(s));
    free(s);
    (void)c;
}

static int gen(sc *c, const json_t *s, const char *path);

static bool is_annotation(const char *k) {
    static const char *ann[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
                                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "name", "example"};
    for (size_t i = 0; i < PD_ARRAY_LEN(ann); i++)
        if (!strcmp(k, ann[i])) return true;
    return false;
}

static bool is_handled(const char *k) {
    static const char *kw[] = {"type", "properties", "required", "additionalProperties", "items", "minItems",
                               "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength",
                               "maxLength", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                               "nullable"};
    for (size_t i = 0; i < PD_ARRAY_LEN(kw); i++)
        if (!strcmp(k, kw[i])) return true;
    return false;
}

static void child_path(char *out, size_t n, const char *path, const char *key) {
    snprintf(out, n, "%s/%s", path, key);
}

static int resolve_ref(sc *c, const char *ref, const char *path) {
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ref, ref)) return c->refs[i].id;
    if (ref[0] != '#') return fail(c, path, "only local $ref ('#/...') is supported, got '%.100s'", ref);
    const json_t *node = c->root;
    const char *p = ref + 1;
    while (*p == '/') {
        p++;
        char key[256];
        size_t k = 0;
        while (*p && *p != '/' && k < sizeof key - 1) {
            if (p[0] == '~' && p[1] == '1') key[k++] = '/', p += 2;
            else if (p[0] == '~' && p[1] == '0') key[k++] = '~', p += 2;
            else key[k++] = *p++;
        }
        key[k] = 0;
        if (json_is_object(node)) node = json_object_get(node, key);
        else if (json_is_array(node)) node = json_array_get(node, (size_t)strtol(key, NULL, 10));
        else node = NULL;
        if (!node) return fail(c, path, "$ref '%.100s' does not resolve", ref);
    }
    if (*p) return fail(c, path, "$ref '%.100s' does not resolve", ref);
    if (PD_ARRAY_RESERVE(c->refs, c->cap_refs, (size_t)c->n_refs + 1)) return c->out.failed = true, -1;
    int id = c->n_rules++;
    c->refs[c->n_refs].ref = pd_strdup(ref);
    if (!c->refs[c->n_refs].ref) return c->out.failed = true, -1;
    c->refs[c->n_refs++].id = id;
    int inner = gen(c, node, ref + 1);
    if (inner < 0) return -1;
    sbuf b = {0};
    sb_printf(&b, "%sr%d", c->prefix, inner);
    emit_rule(c, id, &b);
    return id;
}

static bool get_count(sc *c, const json_t *s, const char *key, long long *out, const char *path) {
    const json_t *v = json_object_get(s, key);
    if (!v) return true;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 10000) {
        fail(c, path, "'%s' must be an integer between 0 and 10000", key);
        return false;
    }
    *out = json_integer_value(v);
    return true;
}

static bool gen_string(sc *c, const json_t *s, sbuf *b, const char *path) {
    const json_t *fmt = json_object_get(s, "format");
    if (fmt) {
        const char *f = json_string_value(fmt);
        static const char *known[] = {"date", "time", "date-time", "email", "uuid"};
        bool ok = false;
        for (size_t i = 0; f && i < PD_ARRAY_LEN(known); i++) ok |= !strcmp(f, known[i]);
        if (!ok) return fail(c, path, "string format '%.60s' is not supported (supported: date, time, date-time, email, uuid)",
                             f ? f : "?"), false;
        sb_printf(b, "\"\\\"\" %s%s \"\\\"\"", c->prefix, f);
        return true;
    }
    if (json_object_get(s, "pattern")) return fail(c, path, "'pattern' is not supported"), false;
    long long lo = 0, hi = -1;
    if (!get_count(c, s, "minLength", &lo, path) || !get_count(c, s, "maxLength", &hi, path)) return false;
    if (hi >= 0 && hi < lo) return fail(c, path, "maxLength is below minLength"), false;
    if (lo == 0 && hi < 0) sb_printf(b, "%sstring", c->prefix);
    else if (hi < 0) sb_printf(b, "\"\\\"\" %schar{%lld,} \"\\\"\"", c->prefix, lo);
    else sb_printf(b, "\"\\\"\" %schar{%lld,%lld} \"\\\"\"", c->prefix, lo, hi);
    return true;
}

static bool num_bound(sc *c, const json_t *s, const char *key, bool *has, long long *v, int adj, const char *path) {
    const json_t *x = json_object_get(s, key);
    if (!x) return true;
    double d = json_number_value(x);
    if (!json_is_number(x) || !(d >= -9e18 && d <= 9e18) || d != (double)(long long)d)
        return fail(c, path, "'%s' must be an integer here", key), false;
    long long n = (long long)d + adj;
    if (*has) *v = adj >= 0 ? PD_MAX(*v, n) : PD_MIN(*v, n);
    else *v = n;
    *has = true;
    return true;
}

static bool gen_integer(sc *c, const json_t *s, sbuf *b, const char *path) {
    if (json_object_get(s, "multipleOf")) return fail(c, path, "'multipleOf' is not supported"), false;
    bool has_lo = false, has_hi = false;
    long long lo = 0, hi = 0;
    if (!num_bound(c, s, "minimum", &has_lo, &lo, 0, path) || !num_bound(c, s, "exclusiveMinimum", &has_lo, &lo, 1, path) ||
        !num_bound(c, s, "maximum", &has_hi, &hi, 0, path) || !num_bound(c, s, "exclusiveMaximum", &has_hi, &hi, -1, path))
        return false;
    if (!has_lo && !has_hi) {
        sb_printf(b, "%sinteger", c->prefix);
        return true;
    }
    if (has_lo && has_hi && hi < lo) return fail(c, path, "the integer range is empty"), false;
    if (has_lo && has_hi && (unsigned long long)hi - (unsigned long long)lo <= 4096) {  // small ranges: every value
        for (long long v = lo; v <= hi; v++) sb_printf(b, "%s\"%lld\"", v == lo ? "( " : " | ", v);
        sb_puts(b, " )");
        return true;
    }
    // Wide ranges (zod's int() is [-(2^53-1), 2^53-1]): whole digit counts that lie inside the range,
    // plus 0 and the single digits when they do. A subset of the range, never a value outside it.
    const long long LIM = 999999999999999ll;  // 15 digits
    long long plo = has_lo ? PD_MAX(lo, 1) : 1, phi = has_hi ? PD_MIN(hi, LIM) : LIM;
    long long nlo = has_hi ? PD_MAX(-hi, 1) : 1, nhi = has_lo ? PD_MIN(-lo, LIM) : LIM;  // |negatives|
    int alts = 0;
    sb_puts(b, "( ");
    if ((!has_lo || lo <= 0) && (!has_hi || hi >= 0)) sb_puts(b, alts++ ? " | \"0\"" : "\"0\"");
    for (int side = 0; side < 2; side++) {
        long long a = side ? nlo : plo, z = side ? nhi : phi;
        if (a > z) continue;
        const char *sign = side ? "\"-\" " : "";
        if (a <= 9) {  // single digits a..min(z, 9)
            sb_printf(b, "%s%s[%lld-%lld]", alts++ ? " | " : "", sign, a, PD_MIN(z, 9ll));
            a = 10;
        }
        int da = 1, dz = 0;  // digit counts whose every value lies in [a, z]
        long long p10 = 1;
        for (int d = 1; d <= 15; d++, p10 *= 10) {
            if (p10 < a) da = d + 1;
            if (p10 * 10 - 1 <= z) dz = d;
        }
        if (da < 2) da = 2;
        if (da <= dz) sb_printf(b, "%s%s[1-9] [0-9]{%d,%d}", alts++ ? " | " : "", sign, da - 1, dz - 1);
    }
    if (!alts) return fail(c, path, "this integer range is not supported (too narrow for its size: give a span <= 4096)"), false;
    sb_puts(b, " )");
    return true;
}

static bool gen_object(sc *c, const json_t *s, sbuf *b, const char *path) {
    static const char *bad[] = {"patternProperties", "minProperties", "maxProperties", "propertyNames",
                                "dependentRequired", "dependentSchemas", "unevaluatedProperties"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++)
        if (json_object_get(s, bad[i])) return fail(c, path, "'%s' is not supported", bad[i]), false;
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return fail(c, path, "'properties' must be an object"), false;
    if (req && !json_is_array(req)) return fail(c, path, "'required' must be an array"), false;
    size_t n = props ? json_object_size(props) : 0;
    if (!n) {
        if (addl && !json_is_false(addl) && !json_is_true(addl)) {  // a map: {"k": <schema>, ...}
            char sub[512];
            child_path(sub, sizeof sub, path, "additionalProperties");
            int v = gen(c, addl, sub);
            if (v < 0) return false;
            const char *P = c->prefix;
            sb_printf(b, "\"{\" %sws ( %sstring %sws \":\" %sws %sr%d %sws", P, P, P, P, P, v, P);
            sb_printf(b, " ( \",\" %sws %sstring %sws \":\" %sws %sr%d %sws )* )? \"}\"", P, P, P, P, P, v, P);
        } else if (json_is_false(addl)) {
            sb_printf(b, "\"{\" %sws \"}\"", c->prefix);
        } else {
            sb_printf(b, "%sobject", c->prefix);
        }
        return true;
    }
    // Rules: kv_i, then chains first_i (nothing written yet) and rest_i (something written).
    size_t i = 0;
    const char *key;
    const json_t *sub;
    int base = c->n_rules;
    c->n_rules += (int)(3 * n + 2);  // kv[n], first[n+1], rest[n+1]
    int kv0 = base, first0 = base + (int)n, rest0 = base + 2 * (int)n + 1;
    json_object_foreach((json_t *)props, key, sub) {
        char sp[512];
        snprintf(sp, sizeof sp, "%s/properties/%s", path, key);
        int v = gen(c, sub, sp);
        if (v < 0) return false;
        sbuf kb = {0};
        sbuf name = {0};
        sb_puts(&name, "\"");
        size_t kl = strlen(key);
        // The key as a JSON string: escape quotes, backslashes and control characters.
        for (size_t k = 0; k < kl; k++) {
            unsigned char ch = (unsigned char)key[k];
            if (ch == '"' || ch == '\\') sb_printf(&name, "\\%c", ch);
            else if (ch < 0x20) sb_printf(&name, "\\u%04x", ch);
            else sb_putn(&name, (const char *)&ch, 1);
        }
        sb_puts(&name, "\"");
        lit(&kb, name.s ? name.s : "", name.len);
        pd_free(name.s);
        sb_printf(&kb, " %sws \":\" %sws %sr%d %sws", c->prefix, c->prefix, c->prefix, v, c->prefix);
        emit_rule(c, kv0 + (int)i, &kb);
        i++;
    }
    i = 0;
    json_object_foreach((json_t *)props, key, sub) {
        bool required = false;
        size_t k;
        const json_t *r;
        json_array_foreach(req, k, r) required |= json_is_string(r) && !strcmp(json_string_value(r), key);
        sbuf fb = {0}, rb = {0};
        sb_printf(&fb, "%sr%d %sr%d", c->prefix, kv0 + (int)i, c->prefix, rest0 + (int)i + 1);
        sb_printf(&rb, "\",\" %sws %sr%d %sr%d", c->prefix, c->prefix, kv0 + (int)i, c->prefix, rest0 + (int)i + 1);
        if (!required) {
            sb_printf(&fb, " | %sr%d", c->prefix, first0 + (int)i + 1);
            sb_printf(&rb, " | %sr%d", c->prefix, rest0 + (int)i + 1);
        }
        emit_rule(c, first0 + (int)i, &fb);
        emit_rule(c, rest0 + (int)i, &rb);
        i++;
    }
    size_t k;
    const json_t *r;
    json_array_foreach(req, k, r) {
        if (!json_is_string(r) || !json_object_get(props, json_string_value(r)))
            return fail(c, path, "required property '%.100s' is not in 'properties'", json_is_string(r) ? json_string_value(r) : "?"), false;
    }
    sbuf e1 = {0}, e2 = {0};
    sb_puts(&e1, "\"\"");
    sb_puts(&e2, "\"\"");
    emit_rule(c, first0 + (int)n, &e1);
    emit_rule(c, rest0 + (int)n, &e2);
    sb_printf(b, "\"{\" %sws %sr%d \"}\"", c->prefix, c->prefix, first0);
    return true;
}

static bool gen_array(sc *c, const json_t *s, sbuf *b, const char *path) {
    static const char *bad[] = {"prefixItems", "uniqueItems", "contains", "minContains", "maxContains",
                                "unevaluatedItems", "additionalItems"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        const json_t *v = json_object_get(s, bad[i]);
        if (v && !(json_is_false(v) && !strcmp(bad[i], "uniqueItems")))
            return fail(c, path, "'%s' is not supported", bad[i]), false;
    }
    const json_t *items = json_object_get(s, "items");
    if (items && json_is_array(items)) return fail(c, path, "'items' as an array (tuple) is not supported"), false;
    char sub[512];
    child_path(sub, sizeof sub, path, "items");
    int v = -1;
    if (items && (v = gen(c, items, sub)) < 0) return false;
    char item[64];
    if (v >= 0) snprintf(item, sizeof item, "%sr%d", c->prefix, v);
    else snprintf(item, sizeof item, "%svalue", c->prefix);
    long long lo = 0, hi = -1;
    if (!get_count(c, s, "minItems", &lo, path) || !get_count(c, s, "maxItems", &hi, path)) return false;
    if (hi >= 0 && hi < lo) return fail(c, path, "maxItems is below minItems"), false;
    const char *P = c->prefix;
    if (hi == 0) {
        sb_printf(b, "\"[\" %sws \"]\"", P);
        return true;
    }
    // "[" ws ( item ws ( "," ws item ws ){lo-1, hi-1} )? "]"   (the group is required when lo > 0)
    sb_printf(b, "\"[\" %sws ( %s %sws ( \",\" %sws %s %sws )", P, item, P, P, item, P);
    long long rlo = lo > 0 ? lo - 1 : 0;
    if (hi < 0) sb_printf(b, "{%lld,}", rlo);
    else sb_printf(b, "{%lld,%lld}", rlo, hi - 1);
    sb_printf(b, " )%s \"]\"", lo > 0 ? "" : "?");
    return true;
}

static bool gen_type(sc *c, const json_t *s, const char *type, sbuf *b, const char *path) {
    if (!strcmp(type, "string")) return gen_string(c, s, b, path);
    if (!strcmp(type, "integer")) return gen_integer(c, s, b, path);
    if (!strcmp(type, "number")) {
        static const char *bad[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"};
        for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++)
            if (json_object_get(s, bad[i])) return fail(c, path, "'%s' on a number is not supported", bad[i]), false;
        sb_printf(b, "%snumber", c->prefix);
        return true;
    }
    if (!strcmp(type, "boolean")) return sb_puts(b, "( \"true\" | \"false\" )"), true;
    if (!strcmp(type, "null")) return sb_puts(b, "\"null\""), true;
    if (!strcmp(type, "object")) return gen_object(c, s, b, path);
    if (!strcmp(type, "array")) return gen_array(c, s, b, path);
    return fail(c, path, "unknown type '%.40s'", type), false;
}

static int gen(sc *c, const json_t *s, const char *path) {
    if (c->failed || c->out.failed) return -1;
    if (++c->depth > 64) return fail(c, path, "schema nested too deeply");
    int id = -1;
    sbuf b = {0};
    if (json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        id = c->n_rules++;
        sb_printf(&b, "%svalue", c->prefix);
        goto done;
    }
    if (!json_is_object(s)) {
        fail(c, path, "a schema must be an object or true");
        goto out;
    }
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)s, key, v) {
        if (!is_annotation(key) && !is_handled(key) && strcmp(key, "multipleOf") && strcmp(key, "pattern") &&
            strcmp(key, "patternProperties") && strcmp(key, "minProperties") && strcmp(key, "maxProperties") &&
            strcmp(key, "prefixItems") && strcmp(key, "uniqueItems") && strcmp(key, "contains") &&
            strcmp(key, "propertyNames")) {
            fail(c, path, "unsupported JSON schema keyword '%.60s'", key);
            goto out;
        }
    }
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        if (!json_is_string(ref)) {
            fail(c, path, "'$ref' must be a string");
            goto out;
        }
        int r = resolve_ref(c, json_string_value(ref), path);
        if (r < 0) goto out;
        id = c->n_rules++;
        sb_printf(&b, "%sr%d", c->prefix, r);
        goto done;
    }
    bool nullable = json_is_true(json_object_get(s, "nullable"));
    const json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    const json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");
    const json_t *all = json_object_get(s, "allOf");
    id = c->n_rules++;
    if (cst) {
        json_lit(c, &b, cst);
    } else if (en) {
        if (!json_is_array(en) || !json_array_size(en)) {
            fail(c, path, "'enum' must be a non-empty array");
            goto out;
        }
        size_t i;
        json_array_foreach(en, i, v) {
            if (i) sb_puts(&b, " | ");
            json_lit(c, &b, v);
        }
    } else if (any) {
        if (!json_is_array(any) || !json_array_size(any)) {
            fail(c, path, "'anyOf' must be a non-empty array");
            goto out;
        }
        size_t i;
        json_array_foreach(any, i, v) {
            char sp[512];
            snprintf(sp, sizeof sp, "%s/anyOf/%zu", path, i);
            int r = gen(c, v, sp);
            if (r < 0) goto out;
            sb_printf(&b, "%s%sr%d", i ? " | " : "", c->prefix, r);
        }
    } else if (all) {
        if (!json_is_array(all) || json_array_size(all) != 1) {
            fail(c, path, "'allOf' is supported with exactly one schema");
            goto out;
        }
        char sp[512];
        child_path(sp, sizeof sp, path, "allOf/0");
        int r = gen(c, json_array_get(all, 0), sp);
        if (r < 0) goto out;
        sb_printf(&b, "%sr%d", c->prefix, r);
    } else {
        const json_t *t = json_object_get(s, "type");
        if (!t) {  // infer from the keywords
            const char *ty = json_object_get(s, "properties") || json_object_get(s, "additionalProperties") ? "object"
                             : json_object_get(s, "items")                                                ? "array"
                             : json_object_get(s, "format") || json_object_get(s, "maxLength")           ? "string"
                                                                                                          : NULL;
            if (ty) {
                if (!gen_type(c, s, ty, &b, path)) goto out;
            } else {
                sb_printf(&b, "%svalue", c->prefix);
            }
        } else if (json_is_string(t)) {
            if (!gen_type(c, s, json_string_value(t), &b, path)) goto out;
        } else if (json_is_array(t) && json_array_size(t)) {
            size_t i;
            json_array_foreach(t, i, v) {
                if (!json_is_string(v)) {
                    fail(c, path, "'type' must be a string or an array of strings");
                    goto out;
                }
                sb_puts(&b, i ? " | ( " : "( ");
                if (!gen_type(c, s, json_string_value(v), &b, path)) goto out;
                sb_puts(&b, " )");
            }
        } else {
            fail(c, path, "'type' must be a string or an array of strings");
            goto out;
        }
    }
    if (nullable) sb_puts(&b, " | \"null\"");
done:
    emit_rule(c, id, &b);
    c->depth--;
    return c->out.failed ? -1 : id;
out:
    pd_free(b.s);
    c->depth--;
    return -1;
}

pd_status pd_grammar_schema_rules(const json_t *schema, const char *prefix, char **buf, size_t *len, size_t *cap,
                                  pd_err *err) {
    sc c = {.out = {*buf, *len, *cap, false}, .root = schema, .prefix = prefix, .err = err};
    sb_printf(&c.out, "# JSON primitives (%s)\n", prefix[0] ? prefix : "no prefix");
    char prims[4096];
    expand_prims(prims, sizeof prims, prefix);
    sb_puts(&c.out, prims);
    int r = gen(&c, schema, "");
    if (r >= 0) sb_printf(&c.out, "%sroot ::= %sr%d\n", prefix, prefix, r);
    for (int i = 0; i < c.n_refs; i++) pd_free(c.refs[i].ref);
    pd_free(c.refs);
    *buf = c.out.s;
    *len = c.out.len;
    *cap = c.out.cap;
    if (c.out.failed) return pd_err_set(err, PD_ERR_NOMEM, "json schema: out of memory");
    return c.failed ? PD_ERR_INVALID : PD_OK;
}

pd_status pd_grammar_schema_to_gbnf(const json_t *schema, char **out, pd_err *err) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    pd_status st = pd_grammar_schema_rules(schema, "", &buf, &len, &cap, err);
    if (st) {
        pd_free(buf);
        *out = NULL;
        return st;
    }
    *out = buf;
    return PD_OK;
}

static char g_json_gbnf[4096];
static void json_gbnf_init(void) {
    static const char head[] = "root ::= object\n";
    memcpy(g_json_gbnf, head, sizeof head - 1);
    expand_prims(g_json_gbnf + sizeof head - 1, sizeof g_json_gbnf - (sizeof head - 1), "");
}

const char *pd_grammar_json_gbnf(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, json_gbnf_init);
    return g_json_gbnf;
}
