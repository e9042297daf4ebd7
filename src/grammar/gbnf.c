// gbnf.c — GBNF text → pd_grammar (see grammar.h for the language).
//
// Parsing builds rules as lists of alternatives of symbols (a byte class or a rule reference);
// groups and repetitions become generated rules, code-point classes become byte classes or
// generated rules of UTF-8 byte sequences. Then: every referenced rule must be defined, `root`
// must exist, left recursion is refused, and the rules are flattened into elements.
#include <ctype.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "grammar/grammar_impl.h"

#define MAX_REPEAT 10000
#define MAX_ELEMS (1 << 22)

typedef struct sym {
    int32_t type, v;
} sym;

typedef struct symvec {
    sym *a;
    int n, cap;
} symvec;

typedef struct prule {
    char *name;  // NULL for generated rules
    symvec *alts;
    int n_alts, cap_alts;
    bool defined;
    int line;    // first reference, for "undefined rule" errors
} prule;

typedef struct parser {
    const char *s, *end, *begin;
    prule *rules;
    int n_rules, cap_rules;
    gclass *classes;
    int n_classes, cap_classes;
    pd_err *err;
    bool failed;
    int depth;
} parser;

static bool grow(void **a, int *cap, int need, size_t elem) {
    if (need <= *cap) return true;
    size_t c = (size_t)*cap;  // the shared checked growth rule; counts here are ints
    if (need < 0 || pd_array_reserve(a, elem, &c, (size_t)need)) return false;
    *cap = c > INT_MAX ? INT_MAX : (int)c;  // under-stating a capacity is safe
    return true;
}

static int line_of(const parser *p, const char *at) {
    int line = 1;
    for (const char *c = p->begin; c < at && c < p->end; c++) line += *c == '\n';
    return line;
}

static bool perr(parser *p, const char *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool perr(parser *p, const char *at, const char *fmt, ...) {
    if (p->failed) return false;
    p->failed = true;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at) pd_err_set(p->err, PD_ERR_INVALID, "grammar: line %d: %s", line_of(p, at), msg);
    else pd_err_set(p->err, PD_ERR_INVALID, "grammar: %s", msg);
    return false;
}

static bool oom(parser *p) {
    if (!p->failed) pd_err_set(p->err, PD_ERR_NOMEM, "grammar: out of memory");
    p->failed = true;
    return false;
}

static bool push_sym(parser *p, symvec *v, int type, int32_t x) {
    if (!grow((void **)&v->a, &v->cap, v->n + 1, sizeof(sym))) return oom(p);
    v->a[v->n++] = (sym){type, x};
    return true;
}

static int new_rule(parser *p, const char *name, size_t n) {
    if (!grow((void **)&p->rules, &p->cap_rules, p->n_rules + 1, sizeof(prule))) return oom(p), -1;
    prule *r = &p->rules[p->n_rules];
    memset(r, 0, sizeof *r);
    if (name) {
        r->name = pd_malloc(n + 1);
        if (!r->name) return oom(p), -1;
        memcpy(r->name, name, n);
        r->name[n] = 0;
    }
    return p->n_rules++;
}

static int rule_by_name(parser *p, const char *name, size_t n, const char *at) {
    for (int i = 0; i < p->n_rules; i++)
        if (p->rules[i].name && strlen(p->rules[i].name) == n && !memcmp(p->rules[i].name, name, n)) return i;
    int r = new_rule(p, name, n);
    if (r >= 0) p->rules[r].line = line_of(p, at);
    return r;
}

static symvec *new_alt(parser *p, int rule) {
    prule *r = &p->rules[rule];
    if (!grow((void **)&r->alts, &r->cap_alts, r->n_alts + 1, sizeof(symvec))) return oom(p), NULL;
    symvec *v = &r->alts[r->n_alts++];
    memset(v, 0, sizeof *v);
    return v;
}

static int add_class(parser *p, const gclass *c) {
    for (int i = 0; i < p->n_classes; i++)
        if (!memcmp(&p->classes[i], c, sizeof *c)) return i;
    if (!grow((void **)&p->classes, &p->cap_classes, p->n_classes + 1, sizeof(gclass))) return oom(p), -1;
    p->classes[p->n_classes] = *c;
    return p->n_classes++;
}

static void class_set(gclass *c, unsigned lo, unsigned hi) {
    for (unsigned b = lo; b <= hi && b < 256; b++) c->w[b >> 6] |= 1ull << (b & 63);
}

static bool push_byte_range(parser *p, symvec *v, unsigned lo, unsigned hi) {
    gclass c = {{0}};
    class_set(&c, lo, hi);
    int id = add_class(p, &c);
    return id >= 0 && push_sym(p, v, GE_CLASS, id);
}

static int utf8_encode(uint32_t cp, uint8_t *out) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { out[0] = (uint8_t)(0xc0 | cp >> 6); out[1] = (uint8_t)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xe0 | cp >> 12); out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (uint8_t)(0xf0 | cp >> 18); out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f)); out[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

// ---- code-point ranges → UTF-8 byte-range sequences ----------------------------------------------

typedef struct cprange {
    uint32_t lo, hi;
} cprange;

// Emits one alternative per byte-range sequence covering [lo, hi] (no surrogates inside).
static bool utf8_seqs(parser *p, int rule, uint32_t lo, uint32_t hi) {
    static const uint32_t bounds[] = {0x7f, 0x7ff, 0xffff};
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i])
            return utf8_seqs(p, rule, lo, bounds[i]) && utf8_seqs(p, rule, bounds[i] + 1, hi);
    uint8_t a[4], b[4];
    int n = utf8_encode(lo, a);
    utf8_encode(hi, b);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m) return utf8_seqs(p, rule, lo, lo | m) && utf8_seqs(p, rule, (lo | m) + 1, hi);
            if ((hi & m) != m) return utf8_seqs(p, rule, lo, (hi & ~m) - 1) && utf8_seqs(p, rule, hi & ~m, hi);
        }
    }
    symvec *v = new_alt(p, rule);
    if (!v) return false;
    for (int i = 0; i < n; i++)
        if (!push_byte_range(p, v, a[i], b[i])) return false;
    return true;
}

static int cmp_range(const void *x, const void *y) {
    const cprange *a = x, *b = y;
    return (a->lo > b->lo) - (a->lo < b->lo);
}

// Lowers a set of code-point ranges (negated or not) into one symbol appended to v.
static bool push_cp_class(parser *p, symvec *v, cprange *r, int n, bool negate, const char *at) {
    qsort(r, (size_t)n, sizeof *r, cmp_range);
    cprange set[512];
    int m = 0;
    for (int i = 0; i < n; i++) {  // merge
        if (m && r[i].lo <= set[m - 1].hi + 1) {
            if (r[i].hi > set[m - 1].hi) set[m - 1].hi = r[i].hi;
        } else {
            if (m == (int)PD_ARRAY_LEN(set) - 1) return perr(p, at, "character class too large");
            set[m++] = r[i];
        }
    }
    if (negate) {
        cprange c[513];
        int k = 0;
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (set[i].lo > next) c[k++] = (cprange){next, set[i].lo - 1};
            next = set[i].hi + 1;
        }
        if (next <= 0x10ffff) c[k++] = (cprange){next, 0x10ffff};
        memcpy(set, c, sizeof(cprange) * (size_t)k);
        m = k;
    }
    // Surrogates are not characters: cut them out.
    cprange fin[520];
    int k = 0;
    for (int i = 0; i < m; i++) {
        uint32_t lo = set[i].lo, hi = PD_MIN(set[i].hi, 0x10ffffu);
        if (lo > hi) continue;
        if (lo <= 0xdfff && hi >= 0xd800) {
            if (lo < 0xd800) fin[k++] = (cprange){lo, 0xd7ff};
            if (hi > 0xdfff) fin[k++] = (cprange){0xe000, hi};
        } else {
            fin[k++] = (cprange){lo, hi};
        }
    }
    if (!k) return perr(p, at, "empty character class");
    gclass ascii = {{0}};
    bool multi = false;
    for (int i = 0; i < k; i++) {
        if (fin[i].lo < 0x80) class_set(&ascii, fin[i].lo, PD_MIN(fin[i].hi, 0x7fu));
        if (fin[i].hi >= 0x80) multi = true;
    }
    bool has_ascii = ascii.w[0] || ascii.w[1];
    if (!multi) {
        int id = add_class(p, &ascii);
        return id >= 0 && push_sym(p, v, GE_CLASS, id);
    }
    int rule = new_rule(p, NULL, 0);
    if (rule < 0) return false;
    p->rules[rule].defined = true;
    if (has_ascii) {
        symvec *a = new_alt(p, rule);
        int id = a ? add_class(p, &ascii) : -1;
        if (id < 0 || !push_sym(p, a, GE_CLASS, id)) return false;
    }
    for (int i = 0; i < k; i++) {
        if (fin[i].hi < 0x80) continue;
        if (!utf8_seqs(p, rule, PD_MAX(fin[i].lo, 0x80u), fin[i].hi)) return false;
    }
    return push_sym(p, v, GE_RULE, rule);
}

// ---- lexing ----------------------------------------------------------------------------------------

static void skip_ws(parser *p) {
    while (p->s < p->end) {
        if (*p->s == '#') {
            while (p->s < p->end && *p->s != '\n') p->s++;
        } else if (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r') {
            p->s++;
        } else {
            break;
        }
    }
}

static bool is_name_char(char c) { return isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.'; }

static size_t name_len(const char *s, const char *end) {
    size_t n = 0;
    while (s + n < end && is_name_char(s[n]) && !(s[n] == '.' && n == 0)) n++;
    return n;
}

// At a rule definition "name ::="?
static bool at_definition(const parser *p) {
    size_t n = name_len(p->s, p->end);
    if (!n) return false;
    const char *c = p->s + n;
    while (c < p->end && (*c == ' ' || *c == '\t')) c++;
    return p->end - c >= 3 && !memcmp(c, "::=", 3);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Decodes one (possibly escaped) UTF-8 character of a literal or class.
static bool read_char(parser *p, uint32_t *cp) {
    const char *at = p->s;
    if (p->s >= p->end) return perr(p, at, "unexpected end of grammar");
    unsigned char c = (unsigned char)*p->s++;
    if (c == '\\') {
        if (p->s >= p->end) return perr(p, at, "unexpected end of grammar after '\\'");
        char e = *p->s++;
        int nhex = 0;
        switch (e) {
        case 'n': *cp = '\n'; return true;
        case 'r': *cp = '\r'; return true;
        case 't': *cp = '\t'; return true;
        case '0': *cp = 0; return true;
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': case '\'':
            *cp = (unsigned char)e;
            return true;
        default: return perr(p, at, "unknown escape '\\%c'", e);
        }
        uint32_t v = 0;
        for (int i = 0; i < nhex; i++) {
            int h = p->s < p->end ? hexval(*p->s) : -1;
            if (h < 0) return perr(p, at, "bad \\%c escape", e);
            v = v * 16 + (uint32_t)h;
            p->s++;
        }
        if (v > 0x10ffff) return perr(p, at, "code point out of range");
        *cp = v;
        return true;
    }
    if (c < 0x80) {
        *cp = c;
        return true;
    }
    int n = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : -1;
    if (n < 0 || p->end - p->s < n) return perr(p, at, "invalid UTF-8 in grammar");
    uint32_t v = c & (0x3f >> n);
    for (int i = 0; i < n; i++) {
        unsigned char d = (unsigned char)*p->s++;
        if ((d & 0xc0) != 0x80) return perr(p, at, "invalid UTF-8 in grammar");
        v = v << 6 | (d & 0x3f);
    }
    *cp = v;
    return true;
}

static bool parse_alternates(parser *p, int rule, bool nested);

// Wraps v->a[from..] into a generated rule (one alternative) and leaves one symbol there.
static int wrap_item(parser *p, symvec *v, int from) {
    if (v->n - from == 1 && v->a[from].type == GE_RULE) {
        v->n = from;
        return v->a[from].v;
    }
    int rule = new_rule(p, NULL, 0);
    if (rule < 0) return -1;
    p->rules[rule].defined = true;
    symvec *a = new_alt(p, rule);
    if (!a) return -1;
    for (int i = from; i < v->n; i++)
        if (!push_sym(p, a, v->a[i].type, v->a[i].v)) return -1;
    v->n = from;
    return rule;
}

// x{min,max} (max < 0: unbounded) applied to the item at v->a[from..].
static bool repeat(parser *p, int rule_of_v, int alt_of_v, int from, int min, int max) {
    symvec *v = &p->rules[rule_of_v].alts[alt_of_v];
    int x = wrap_item(p, v, from);
    if (x < 0) return false;
    v = &p->rules[rule_of_v].alts[alt_of_v];  // p->rules may have moved
    for (int i = 0; i < min; i++)
        if (!push_sym(p, v, GE_RULE, x)) return false;
    if (max == min) return true;
    int tail;
    if (max < 0) {  // star ::= x star | ε  (a tail call: the stack does not grow)
        tail = new_rule(p, NULL, 0);
        if (tail < 0) return false;
        p->rules[tail].defined = true;
        symvec *a = new_alt(p, tail);
        if (!a || !push_sym(p, a, GE_RULE, x) || !push_sym(p, a, GE_RULE, tail) || !new_alt(p, tail)) return false;
    } else {  // opt_k ::= x opt_{k-1} | ε, opt_1 ::= x | ε
        tail = -1;
        for (int k = 1; k <= max - min; k++) {
            int r = new_rule(p, NULL, 0);
            if (r < 0) return false;
            p->rules[r].defined = true;
            symvec *a = new_alt(p, r);
            if (!a || !push_sym(p, a, GE_RULE, x)) return false;
            if (tail >= 0 && !push_sym(p, &p->rules[r].alts[0], GE_RULE, tail)) return false;
            if (!new_alt(p, r)) return false;
            tail = r;
        }
    }
    v = &p->rules[rule_of_v].alts[alt_of_v];
    return push_sym(p, v, GE_RULE, tail);
}

static bool read_int(parser *p, int *out) {
    const char *at = p->s;
    long v = 0;
    if (p->s >= p->end || !isdigit((unsigned char)*p->s)) return perr(p, at, "expected a number");
    while (p->s < p->end && isdigit((unsigned char)*p->s)) {
        v = v * 10 + (*p->s++ - '0');
        if (v > MAX_REPEAT) return perr(p, at, "repetition count above %d", MAX_REPEAT);
    }
    *out = (int)v;
    return true;
}

static bool parse_sequence(parser *p, int rule, bool nested) {
    symvec *first = new_alt(p, rule);
    if (!first) return false;
    int alt = p->rules[rule].n_alts - 1;
#define V (&p->rules[rule].alts[alt])
    int item = -1;  // start of the last item (for postfix operators)
    for (;;) {
        skip_ws(p);
        if (p->s >= p->end || *p->s == '|' || *p->s == ')') break;
        if (!nested && at_definition(p)) break;
        const char *at = p->s;
        char c = *p->s;
        if (c == '"') {
            p->s++;
            item = V->n;
            while (p->s < p->end && *p->s != '"') {
                uint32_t cp;
                if (!read_char(p, &cp)) return false;
                uint8_t b[4];
                int n = utf8_encode(cp, b);
                for (int i = 0; i < n; i++)
                    if (!push_byte_range(p, V, b[i], b[i])) return false;
            }
            if (p->s >= p->end) return perr(p, at, "unterminated string literal");
            p->s++;
            if (V->n == item) item = -1;  // "" adds nothing
        } else if (c == '[') {
            p->s++;
            bool neg = p->s < p->end && *p->s == '^';
            if (neg) p->s++;
            cprange r[256];
            int n = 0;
            while (p->s < p->end && *p->s != ']') {
                uint32_t lo, hi;
                if (!read_char(p, &lo)) return false;
                hi = lo;
                if (p->end - p->s >= 2 && *p->s == '-' && p->s[1] != ']') {
                    p->s++;
                    if (!read_char(p, &hi)) return false;
                    if (hi < lo) return perr(p, at, "bad range in character class");
                }
                if (n == (int)PD_ARRAY_LEN(r)) return perr(p, at, "character class too large");
                r[n++] = (cprange){lo, hi};
            }
            if (p->s >= p->end) return perr(p, at, "unterminated character class");
            p->s++;
            if (!n && !neg) return perr(p, at, "empty character class");
            item = V->n;
            if (!push_cp_class(p, V, r, n, neg, at)) return false;
        } else if (c == '.') {
            p->s++;
            cprange r = {0, 0x10ffff};
            item = V->n;
            if (!push_cp_class(p, V, &r, 1, false, at)) return false;
        } else if (c == '(') {
            p->s++;
            if (++p->depth > 100) return perr(p, at, "groups nested too deeply");
            int g = new_rule(p, NULL, 0);
            if (g < 0) return false;
            p->rules[g].defined = true;
            if (!parse_alternates(p, g, true)) return false;
            p->depth--;
            skip_ws(p);
            if (p->s >= p->end || *p->s != ')') return perr(p, at, "missing ')'");
            p->s++;
            item = V->n;
            if (!push_sym(p, V, GE_RULE, g)) return false;
        } else if (name_len(p->s, p->end)) {
            size_t n = name_len(p->s, p->end);
            int r = rule_by_name(p, p->s, n, p->s);
            if (r < 0) return false;
            p->s += n;
            item = V->n;
            if (!push_sym(p, V, GE_RULE, r)) return false;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (item < 0) return perr(p, at, "'%c' without anything to repeat", c);
            p->s++;
            int min = 0, max = -1;
            if (c == '+') min = 1;
            else if (c == '?') max = 1;
            else if (c == '{') {
                skip_ws(p);
                if (!read_int(p, &min)) return false;
                skip_ws(p);
                if (p->s < p->end && *p->s == ',') {
                    p->s++;
                    skip_ws(p);
                    if (p->s < p->end && *p->s != '}') {
                        if (!read_int(p, &max)) return false;
                        if (max < min) return perr(p, at, "repetition {%d,%d}: max below min", min, max);
                    }
                } else {
                    max = min;
                }
                skip_ws(p);
                if (p->s >= p->end || *p->s != '}') return perr(p, at, "missing '}'");
                p->s++;
            }
            if (!repeat(p, rule, alt, item, min, max)) return false;
            item = -1;  // x** is an error
        } else {
            return perr(p, at, "unexpected character '%c'", c);
        }
    }
#undef V
    return true;
}

static bool parse_alternates(parser *p, int rule, bool nested) {
    if (!parse_sequence(p, rule, nested)) return false;
    for (;;) {
        skip_ws(p);
        if (p->s >= p->end || *p->s != '|') return true;
        p->s++;
        if (!parse_sequence(p, rule, nested)) return false;
    }
}

static bool parse_grammar(parser *p) {
    for (;;) {
        skip_ws(p);
        if (p->s >= p->end) return true;
        const char *at = p->s;
        size_t n = name_len(p->s, p->end);
        if (!n || !at_definition(p)) return perr(p, at, "expected a rule definition 'name ::= ...'");
        int r = rule_by_name(p, p->s, n, p->s);
        if (r < 0) return false;
        if (p->rules[r].defined) return perr(p, at, "rule '%s' defined twice", p->rules[r].name);
        p->rules[r].defined = true;
        p->s = strstr(p->s, "::=") + 3;
        if (!parse_alternates(p, r, false)) return false;
    }
}

// ---- checks and flattening ---------------------------------------------------------------------

static bool check(parser *p, int *root) {
    *root = -1;
    for (int i = 0; i < p->n_rules; i++) {
        prule *r = &p->rules[i];
        if (!r->defined) return perr(p, NULL, "line %d: undefined rule '%s'", r->line, r->name);
        if (r->name && !strcmp(r->name, "root")) *root = i;
    }
    if (*root < 0) return perr(p, NULL, "no 'root' rule");
    bool *nullable = pd_calloc((size_t)p->n_rules, 1);
    uint8_t *color = pd_calloc((size_t)p->n_rules, 1);
    int *stack = pd_malloc(sizeof(int) * (size_t)p->n_rules * 2);
    if (!nullable || !color || !stack) {
        pd_free(nullable); pd_free(color); pd_free(stack);
        return oom(p);
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int i = 0; i < p->n_rules; i++) {
            if (nullable[i]) continue;
            for (int a = 0; a < p->rules[i].n_alts && !nullable[i]; a++) {
                symvec *v = &p->rules[i].alts[a];
                bool all = true;
                for (int k = 0; k < v->n && all; k++) all = v->a[k].type == GE_RULE && nullable[v->a[k].v];
                if (all) nullable[i] = changed = true;
            }
        }
    }
    // Left recursion: a cycle of "A may start with B" edges (through nullable prefixes).
    // Iterative DFS: stack holds (rule, next alt*65536+sym cursor) pairs; color 1 = on path.
    bool ok = true;
    for (int s = 0; s < p->n_rules && ok; s++) {
        if (color[s]) continue;
        int sp = 0;
        stack[sp++] = s;
        stack[sp++] = 0;
        color[s] = 1;
        while (sp && ok) {
            int r = stack[sp - 2], cur = stack[sp - 1];
            int a = cur >> 16, k = cur & 0xffff;
            prule *pr = &p->rules[r];
            int next = -1;
            while (a < pr->n_alts && next < 0) {
                symvec *v = &pr->alts[a];
                bool blocked = false;
                for (int j = 0; j < k && !blocked; j++) blocked = v->a[j].type != GE_RULE || !nullable[v->a[j].v];
                if (blocked || k >= v->n || v->a[k].type != GE_RULE) {
                    a++;
                    k = 0;
                    continue;
                }
                next = v->a[k].v;
                k++;
            }
            stack[sp - 1] = a << 16 | k;
            if (next < 0) {
                color[r] = 2;
                sp -= 2;
            } else if (color[next] == 1) {
                const char *name = p->rules[next].name ? p->rules[next].name : p->rules[r].name;
                ok = perr(p, NULL, "left recursion%s%s%s (a rule that can start with itself)", name ? " in rule '" : "",
                          name ? name : "", name ? "'" : "");
            } else if (!color[next]) {
                color[next] = 1;
                stack[sp++] = next;
                stack[sp++] = 0;
            }
        }
    }
    pd_free(nullable);
    pd_free(color);
    pd_free(stack);
    return ok;
}

// ---- inlining ------------------------------------------------------------------------------------------
// A token mask is precomputed per grammar position with nothing known below the position's rule
// (match.c), so a token that leaves the rule must be checked at run time. Small helper rules
// (JSON's `char`, a repeated [0-9], a UTF-8 class) would make nearly every token leave them after a
// byte or two: `string ::= "\"" char* "\""` is a loop of one-character calls. Splicing small,
// non-recursive rules into their callers turns such loops into one tail-recursive rule, whose
// positions judge whole runs of characters on their own. The language does not change.

#define INLINE_MAX_ALTS 16     // alternatives of a rule that may be inlined
#define INLINE_MAX_SYMS 48     // symbols in all its alternatives
#define INLINE_MAX_RESULT 64   // alternatives a rule may grow to

static bool rule_reaches(const parser *p, int from, int target, uint8_t *seen) {
    if (seen[from]) return false;
    seen[from] = 1;
    const prule *r = &p->rules[from];
    for (int a = 0; a < r->n_alts; a++)
        for (int k = 0; k < r->alts[a].n; k++) {
            const sym *x = &r->alts[a].a[k];
            if (x->type != GE_RULE) continue;
            if (x->v == target || rule_reaches(p, x->v, target, seen)) return true;
        }
    return false;
}

static bool inline_rules(parser *p, int root) {
    int n = p->n_rules;
    bool *can = pd_calloc((size_t)n, sizeof(bool));
    uint8_t *seen = pd_malloc((size_t)n);
    if (!can || !seen) {
        pd_free(can);
        pd_free(seen);
        return oom(p);
    }
    for (int b = 0; b < n; b++) {  // recursion never changes; sizes do, so they are checked at each use
        memset(seen, 0, (size_t)n);
        can[b] = b != root && p->rules[b].n_alts >= 1 && !rule_reaches(p, b, b, seen);
    }
    bool ok = true;
    for (int rr = 0; rr < n && ok; rr++) {
        for (int a = 0; a < p->rules[rr].n_alts && ok; a++) {
            for (int k = 0; k < p->rules[rr].alts[a].n && ok;) {
                sym x = p->rules[rr].alts[a].a[k];
                prule *B = &p->rules[x.v];
                // Not at the end of the alternative: a tail call keeps the caller's frame anyway, and
                // unrolling repetition chains there would only grow the grammar.
                int syms = 0;
                for (int i = 0; x.type == GE_RULE && i < B->n_alts; i++) syms += B->alts[i].n;
                // A rule of several alternatives only into a short alternative (the `x tail` loop of a
                // repetition): in longer sequences they would multiply out.
                if (x.type != GE_RULE || k == p->rules[rr].alts[a].n - 1 || !can[x.v] || B->n_alts > INLINE_MAX_ALTS ||
                    syms > INLINE_MAX_SYMS || (B->n_alts > 1 && p->rules[rr].alts[a].n > 2) ||
                    p->rules[rr].n_alts - 1 + B->n_alts > INLINE_MAX_RESULT) {
                    k++;
                    continue;
                }
                // alt = pre B post  →  pre b_i post for every alternative b_i of B (the first in place).
                symvec old = p->rules[rr].alts[a];
                int nb = B->n_alts;
                for (int i = 1; i < nb && ok; i++) {
                    symvec *v = new_alt(p, rr);  // may move p->rules[rr].alts, not the symbol arrays
                    B = &p->rules[x.v];
                    if (!v) {
                        ok = false;
                        break;
                    }
                    const symvec *bi = &B->alts[i];
                    for (int j = 0; j < k && ok; j++) ok = push_sym(p, v, old.a[j].type, old.a[j].v);
                    for (int j = 0; j < bi->n && ok; j++) ok = push_sym(p, v, bi->a[j].type, bi->a[j].v);
                    for (int j = k + 1; j < old.n && ok; j++) ok = push_sym(p, v, old.a[j].type, old.a[j].v);
                }
                if (!ok) break;
                B = &p->rules[x.v];
                symvec cur = {0};
                const symvec *b0 = &B->alts[0];
                for (int j = 0; j < k && ok; j++) ok = push_sym(p, &cur, old.a[j].type, old.a[j].v);
                for (int j = 0; j < b0->n && ok; j++) ok = push_sym(p, &cur, b0->a[j].type, b0->a[j].v);
                for (int j = k + 1; j < old.n && ok; j++) ok = push_sym(p, &cur, old.a[j].type, old.a[j].v);
                if (!ok) {
                    pd_free(cur.a);
                    break;
                }
                pd_free(old.a);
                p->rules[rr].alts[a] = cur;
                // k stays: the spliced symbols are looked at next (nested small rules inline too).
            }
        }
    }
    pd_free(can);
    pd_free(seen);
    return ok;
}

static pd_grammar *flatten(parser *p, int root, const pd_grammar_vocab *vocab) {
    int n_elems = 0, n_alts = 0;
    for (int i = 0; i < p->n_rules; i++) {
        n_alts += p->rules[i].n_alts;
        for (int a = 0; a < p->rules[i].n_alts; a++) n_elems += p->rules[i].alts[a].n + 1;
    }
    if (n_elems > MAX_ELEMS) return perr(p, NULL, "grammar too large (%d elements)", n_elems), NULL;
    pd_grammar *g = pd_calloc(1, sizeof *g);
    if (!g) return oom(p), NULL;
    g->refs = 1;
    g->vocab = vocab;
    pthread_mutex_init(&g->mu, NULL);
    g->elems = pd_malloc(sizeof(gelem) * (size_t)n_elems);
    g->alts = pd_malloc(sizeof(int32_t) * (size_t)(n_alts ? n_alts : 1));
    g->alt_begin = pd_malloc(sizeof(int32_t) * (size_t)(p->n_rules + 1));
    g->classes = pd_malloc(sizeof(gclass) * (size_t)(p->n_classes ? p->n_classes : 1));
    g->cache = pd_calloc((size_t)n_elems, sizeof *g->cache);
    if (!g->elems || !g->alts || !g->alt_begin || !g->classes || !g->cache) {
        pd_grammar_unref(g);
        return oom(p), NULL;
    }
    memcpy(g->classes, p->classes, sizeof(gclass) * (size_t)p->n_classes);
    g->n_classes = p->n_classes;
    g->n_rules = p->n_rules;
    g->root = root;
    int e = 0, k = 0;
    for (int i = 0; i < p->n_rules; i++) {
        g->alt_begin[i] = k;
        for (int a = 0; a < p->rules[i].n_alts; a++) {
            symvec *v = &p->rules[i].alts[a];
            g->alts[k++] = e;
            for (int j = 0; j < v->n; j++) g->elems[e++] = (gelem){v->a[j].type, v->a[j].v};
            g->elems[e++] = (gelem){GE_END, 0};
        }
    }
    g->alt_begin[p->n_rules] = k;
    g->n_elems = e;
    return g;
}

static void parser_fini(parser *p) {
    for (int i = 0; i < p->n_rules; i++) {
        for (int a = 0; a < p->rules[i].n_alts; a++) pd_free(p->rules[i].alts[a].a);
        pd_free(p->rules[i].alts);
        pd_free(p->rules[i].name);
    }
    pd_free(p->rules);
    pd_free(p->classes);
}

pd_grammar *pd_grammar_new(const char *gbnf, size_t len, const pd_grammar_vocab *vocab, pd_err *err) {
    parser p = {.s = gbnf, .end = gbnf + len, .begin = gbnf, .err = err};
    int root = -1;
    pd_grammar *g = NULL;
    if (parse_grammar(&p) && check(&p, &root) && inline_rules(&p, root)) g = flatten(&p, root, vocab);
    parser_fini(&p);
    return g;
}

pd_grammar *pd_grammar_ref(pd_grammar *g) {
    __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    return g;
}

void pd_grammar_unref(pd_grammar *g) {
    if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
    if (g->cache) pd_grammar_cache_free(g);
    pthread_mutex_destroy(&g->mu);
    pd_free(g->elems);
    pd_free(g->alts);
    pd_free(g->alt_begin);
    pd_free(g->classes);
    pd_free(g);
}

int pd_grammar_n_elems(const pd_grammar *g) { return g->n_elems; }
