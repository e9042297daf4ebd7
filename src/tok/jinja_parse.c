// jinja_parse.c — recursive-descent parser from tokens to the AST, following jinja2's Parser
// (grammar, precedence and the quirks templates rely on):
//
//   expression := or ['if' or ['else' expression]]
//   or         := and ('or' and)*          and := not ('and' not)*
//   not        := 'not' not | compare      compare := math1 ((==|!=|<|<=|>|>=|in|not in) math1)*
//   math1      := concat ((+|-) concat)*   concat := math2 ('~' math2)*
//   math2      := pow ((*|/|//|%) pow)*    pow := unary ('**' unary)*   (left-associative, as jinja2)
//   unary      := (-|+) unary | primary postfix* ('|' filter | 'is' test | call)*
//
// Filters bind tighter than any operator (`'a' + x|trim` trims x only) and a unary minus binds
// before filters (`-1|abs` is 1), exactly as in jinja2. Filter and test names are resolved here, so
// an unknown one is a syntax error (jinja2 reports it when compiling, too).
//
// All nodes and strings live in the template's arena; the parser allocates nothing else except
// the json constants (tracked in tmpl->consts). Recursion is bounded by JJ_MAX_PARSE_DEPTH.
#include <string.h>

#include "tok/jinja_impl.h"

#define JJ_MAX_PARSE_DEPTH 200

typedef struct parser {
    pd_jinja_tmpl *t;
    jj_tok *toks;
    size_t n_toks, pos;
    int depth;
    int loop_depth;   // for break/continue
    int n_loop_refs;  // occurrences of the name `loop` so far
    pd_err *err;
    bool failed;
} parser;

typedef struct nvec {
    jj_node **v;
    size_t n, cap;
} nvec;

typedef struct svec {
    const char **v;
    size_t n, cap;
} svec;

static jj_tok *cur(parser *p) { return &p->toks[p->pos]; }
static jj_tok *peek(parser *p, size_t k) {
    return p->pos + k < p->n_toks ? &p->toks[p->pos + k] : &p->toks[p->n_toks - 1];
}
static void next(parser *p) { if (p->pos + 1 < p->n_toks) p->pos++; }
static bool is_op(const jj_tok *t, int op) { return t->kind == JJ_T_OP && t->op == op; }
static bool is_name(const jj_tok *t, const char *s) { return t->kind == JJ_T_NAME && !strcmp(t->str, s); }

static const char *describe(const jj_tok *t, char *buf, size_t n) {
    static const char *const ops[] = {"", "+", "-", "/", "//", "*", "%", "**", "~", "[", "]", "(", ")",
                                      "{", "}", "==", "!=", ">", ">=", "<", "<=", "=", ".", ":", "|",
                                      ",", ";"};
    switch (t->kind) {
    case JJ_T_EOF: return "end of template";
    case JJ_T_DATA: return "template data";
    case JJ_T_VAR_BEGIN: return "begin of print statement";
    case JJ_T_VAR_END: return "end of print statement";
    case JJ_T_BLOCK_BEGIN: return "begin of statement block";
    case JJ_T_BLOCK_END: return "end of statement block";
    case JJ_T_STRING: return "string";
    case JJ_T_INT: return "integer";
    case JJ_T_FLOAT: return "float";
    case JJ_T_NAME: snprintf(buf, n, "'%.40s'", t->str); return buf;
    default: snprintf(buf, n, "'%s'", t->op < PD_ARRAY_LEN(ops) ? ops[t->op] : "?"); return buf;
    }
}

static void *fail_at(parser *p, const jj_tok *t, const char *fmt, const char *arg) {
    if (!p->failed) {
        char msg[256];
        snprintf(msg, sizeof msg, fmt, arg ? arg : "");
        pd_err_set(p->err, PD_ERR_INVALID, "line %d:%d: %s", t->line, t->col, msg);
        p->failed = true;
    }
    return NULL;
}

static void *unexpected(parser *p) {
    char buf[64];
    return fail_at(p, cur(p), "unexpected %s", describe(cur(p), buf, sizeof buf));
}

static void *nomem(parser *p) {
    if (!p->failed) pd_err_set(p->err, PD_ERR_NOMEM, "out of memory parsing template");
    p->failed = true;
    return NULL;
}

static jj_node *node_new(parser *p, int kind, const jj_tok *at) {
    jj_node *n = jj_arena_alloc(&p->t->arena, sizeof *n);
    if (!n) return nomem(p);
    n->kind = (uint8_t)kind;
    n->line = at->line;
    n->col = at->col;
    return n;
}

static bool nvec_push(parser *p, nvec *v, jj_node *x) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 4;
        jj_node **nv = jj_arena_alloc(&p->t->arena, cap * sizeof *nv);
        if (!nv) return nomem(p), false;
        if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return true;
}

static bool svec_push(parser *p, svec *v, const char *x) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 4;
        const char **nv = jj_arena_alloc(&p->t->arena, cap * sizeof *nv);
        if (!nv) return nomem(p), false;
        if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return true;
}

static bool expect_op(parser *p, int op, const char *what) {
    if (is_op(cur(p), op)) {
        next(p);
        return true;
    }
    char buf[64];
    char msg[128];
    snprintf(msg, sizeof msg, "expected '%s', got %s", what, describe(cur(p), buf, sizeof buf));
    fail_at(p, cur(p), "%s", msg);
    return false;
}

static bool expect_kind(parser *p, int kind, const char *what) {
    if (cur(p)->kind == kind) {
        next(p);
        return true;
    }
    char buf[64];
    char msg[128];
    snprintf(msg, sizeof msg, "expected %s, got %s", what, describe(cur(p), buf, sizeof buf));
    fail_at(p, cur(p), "%s", msg);
    return false;
}

static const char *expect_name(parser *p) {
    if (cur(p)->kind != JJ_T_NAME) {
        char buf[64];
        return fail_at(p, cur(p), "expected a name, got %s", describe(cur(p), buf, sizeof buf));
    }
    const char *s = cur(p)->str;
    next(p);
    return s;
}

static jj_node *const_node(parser *p, const jj_tok *at, jv v) {
    jj_node *n = node_new(p, JJ_E_CONST, at);
    if (!n) {
        jv_drop(&v);
        return NULL;
    }
    if (v.kind == JV_STR) {
        pd_jinja_tmpl *t = p->t;
        if (PD_ARRAY_RESERVE(t->consts, t->cap_consts, t->n_consts + 1) != PD_OK) {
            jv_drop(&v);
            return nomem(p);
        }
        t->consts[t->n_consts++] = v.u.j;
    }
    n->value = v;
    return n;
}

static bool depth_enter(parser *p) {
    if (++p->depth <= JJ_MAX_PARSE_DEPTH) return true;
    fail_at(p, cur(p), "template nested too deeply%s", NULL);
    return false;
}

static jj_node *parse_expression(parser *p, bool with_condexpr);
static jj_node *parse_tuple(parser *p, bool simplified, bool with_condexpr, const char *extra_end,
                            bool explicit_parens);
static jj_node *parse_primary(parser *p);
static jj_node *parse_postfix(parser *p, jj_node *node);
static jj_node *parse_filter_expr(parser *p, jj_node *node);
static jj_node *parse_unary(parser *p, bool with_filter);

// ---- calls, filters, tests ------------------------------------------------------------------------
// (args...) into n->args / n->kwnames / n->kwargs. The current token is '('.
static bool parse_call_args(parser *p, jj_node *n) {
    nvec args = {0}, kwargs = {0};
    svec names = {0};
    if (!expect_op(p, JJ_TOP_LPAREN, "(")) return false;
    while (!is_op(cur(p), JJ_TOP_RPAREN)) {
        if (args.n || kwargs.n) {
            if (!expect_op(p, JJ_TOP_COMMA, ",")) return false;
            if (is_op(cur(p), JJ_TOP_RPAREN)) break;
        }
        if (is_op(cur(p), JJ_TOP_MUL) || is_op(cur(p), JJ_TOP_POW))
            return fail_at(p, cur(p), "*args and **kwargs in calls are not supported%s", NULL), false;
        if (cur(p)->kind == JJ_T_NAME && is_op(peek(p, 1), JJ_TOP_ASSIGN)) {
            const char *key = cur(p)->str;
            next(p);
            next(p);
            jj_node *val = parse_expression(p, true);
            if (!val || !svec_push(p, &names, key) || !nvec_push(p, &kwargs, val)) return false;
        } else {
            if (kwargs.n) return fail_at(p, cur(p), "invalid syntax for function call expression%s", NULL), false;
            jj_node *val = parse_expression(p, true);
            if (!val || !nvec_push(p, &args, val)) return false;
        }
    }
    next(p);  // ')'
    n->args = args.v;
    n->n_args = args.n;
    n->kwnames = names.v;
    n->kwargs = kwargs.v;
    n->n_kwargs = kwargs.n;
    return true;
}

// Dotted name after '|' or 'is' (names are looked up as written, dots included).
static const char *parse_dotted(parser *p) {
    const char *name = expect_name(p);
    while (name && is_op(cur(p), JJ_TOP_DOT)) {
        next(p);
        const char *more = expect_name(p);
        if (!more) return NULL;
        size_t a = strlen(name), b = strlen(more);
        char *joined = jj_arena_alloc(&p->t->arena, a + b + 2);
        if (!joined) return nomem(p);
        memcpy(joined, name, a);
        joined[a] = '.';
        memcpy(joined + a + 1, more, b + 1);
        name = joined;
    }
    return name;
}

static jj_node *parse_filter(parser *p, jj_node *node, bool start_inline) {
    while (is_op(cur(p), JJ_TOP_PIPE) || start_inline) {
        if (!start_inline) next(p);
        start_inline = false;
        jj_tok *at = cur(p);
        const char *name = parse_dotted(p);
        if (!name) return NULL;
        int id = jj_filter_lookup(name);
        if (id < 0) return fail_at(p, at, "No filter named '%s'.", name);
        jj_node *f = node_new(p, JJ_E_FILTER, at);
        if (!f) return NULL;
        f->a = node;
        f->op = (uint8_t)id;
        f->str = name;
        if (is_op(cur(p), JJ_TOP_LPAREN) && !parse_call_args(p, f)) return NULL;
        node = f;
    }
    return node;
}

static jj_node *parse_test(parser *p, jj_node *node) {
    jj_tok *at = cur(p);
    next(p);  // 'is'
    bool negated = false;
    if (is_name(cur(p), "not")) {
        next(p);
        negated = true;
    }
    jj_tok *name_tok = cur(p);
    const char *name = parse_dotted(p);
    if (!name) return NULL;
    int id = jj_test_lookup(name);
    if (id < 0) return fail_at(p, name_tok, "No test named '%s'.", name);
    jj_node *t = node_new(p, JJ_E_TEST, at);
    if (!t) return NULL;
    t->a = node;
    t->op = (uint8_t)id;
    t->str = name;
    jj_tok *c = cur(p);
    if (is_op(c, JJ_TOP_LPAREN)) {
        if (!parse_call_args(p, t)) return NULL;
    } else if ((c->kind == JJ_T_NAME && !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) ||
               c->kind == JJ_T_STRING || c->kind == JJ_T_INT || c->kind == JJ_T_FLOAT ||
               is_op(c, JJ_TOP_LBRACKET) || is_op(c, JJ_TOP_LBRACE)) {
        if (is_name(c, "is")) return fail_at(p, c, "You cannot chain multiple tests with is%s", NULL);
        jj_node *arg = parse_primary(p);
        if (arg) arg = parse_postfix(p, arg);
        if (!arg) return NULL;
        t->args = jj_arena_alloc(&p->t->arena, sizeof *t->args);
        if (!t->args) return nomem(p);
        t->args[0] = arg;
        t->n_args = 1;
    }
    if (!negated) return t;
    jj_node *n = node_new(p, JJ_E_NOT, at);
    if (n) n->a = t;
    return n;
}

static jj_node *parse_call(parser *p, jj_node *callee) {
    jj_node *c = node_new(p, JJ_E_CALL, cur(p));
    if (!c) return NULL;
    c->a = callee;
    return parse_call_args(p, c) ? c : NULL;
}

// ---- subscripts -----------------------------------------------------------------------------------
static jj_node *parse_subscribed(parser *p) {
    jj_tok *at = cur(p);
    jj_node *args[3] = {NULL, NULL, NULL};
    if (is_op(cur(p), JJ_TOP_COLON)) {
        next(p);
    } else {
        jj_node *e = parse_expression(p, true);
        if (!e || !is_op(cur(p), JJ_TOP_COLON)) return e;
        next(p);
        args[0] = e;
    }
    if (!is_op(cur(p), JJ_TOP_COLON) && !is_op(cur(p), JJ_TOP_RBRACKET) && !is_op(cur(p), JJ_TOP_COMMA)) {
        if (!(args[1] = parse_expression(p, true))) return NULL;
    }
    if (is_op(cur(p), JJ_TOP_COLON)) {
        next(p);
        if (!is_op(cur(p), JJ_TOP_RBRACKET) && !is_op(cur(p), JJ_TOP_COMMA)) {
            if (!(args[2] = parse_expression(p, true))) return NULL;
        }
    }
    jj_node *s = node_new(p, JJ_E_SLICE, at);
    if (!s) return NULL;
    s->b = args[0];
    s->c = args[1];
    s->d = args[2];
    return s;
}

static jj_node *parse_subscript(parser *p, jj_node *node) {
    jj_tok *at = cur(p);
    if (is_op(at, JJ_TOP_DOT)) {
        next(p);
        jj_tok *t = cur(p);
        if (t->kind == JJ_T_NAME) {
            next(p);
            jj_node *n = node_new(p, JJ_E_ATTR, at);
            if (!n) return NULL;
            n->a = node;
            n->str = t->str;
            n->len = t->len;
            return n;
        }
        if (t->kind == JJ_T_INT) {
            next(p);
            jj_node *key = const_node(p, t, jv_int(t->i));
            jj_node *n = key ? node_new(p, JJ_E_ITEM, at) : NULL;
            if (!n) return NULL;
            n->a = node;
            n->b = key;
            return n;
        }
        return fail_at(p, t, "expected name or number%s", NULL);
    }
    next(p);  // '['
    if (is_op(cur(p), JJ_TOP_RBRACKET)) return unexpected(p);
    jj_node *arg = parse_subscribed(p);
    if (!arg) return NULL;
    if (is_op(cur(p), JJ_TOP_COMMA)) return fail_at(p, cur(p), "tuple subscripts are not supported%s", NULL);
    if (!expect_op(p, JJ_TOP_RBRACKET, "]")) return NULL;
    if (arg->kind == JJ_E_SLICE && !arg->a) {
        arg->a = node;
        return arg;
    }
    jj_node *n = node_new(p, JJ_E_ITEM, at);
    if (!n) return NULL;
    n->a = node;
    n->b = arg;
    return n;
}

static jj_node *parse_postfix(parser *p, jj_node *node) {
    while (node) {
        jj_tok *t = cur(p);
        if (is_op(t, JJ_TOP_DOT) || is_op(t, JJ_TOP_LBRACKET)) node = parse_subscript(p, node);
        else if (is_op(t, JJ_TOP_LPAREN)) node = parse_call(p, node);
        else break;
    }
    return node;
}

static jj_node *parse_filter_expr(parser *p, jj_node *node) {
    while (node) {
        jj_tok *t = cur(p);
        if (is_op(t, JJ_TOP_PIPE)) node = parse_filter(p, node, false);
        else if (is_name(t, "is")) node = parse_test(p, node);
        else if (is_op(t, JJ_TOP_LPAREN)) node = parse_call(p, node);
        else break;
    }
    return node;
}

// ---- primaries ------------------------------------------------------------------------------------
static jj_node *parse_list_or_dict(parser *p, bool is_dict) {
    jj_tok *at = cur(p);
    int close = is_dict ? JJ_TOP_RBRACE : JJ_TOP_RBRACKET;
    next(p);
    nvec keys = {0}, vals = {0};
    while (!is_op(cur(p), close)) {
        if (keys.n) {
            if (!expect_op(p, JJ_TOP_COMMA, ",")) return NULL;
            if (is_op(cur(p), close)) break;
        }
        jj_node *k = parse_expression(p, true);
        if (!k || !nvec_push(p, &keys, k)) return NULL;
        if (is_dict) {
            if (!expect_op(p, JJ_TOP_COLON, ":")) return NULL;
            jj_node *v = parse_expression(p, true);
            if (!v || !nvec_push(p, &vals, v)) return NULL;
        }
    }
    next(p);
    jj_node *n = node_new(p, is_dict ? JJ_E_DICT : JJ_E_LIST, at);
    if (!n) return NULL;
    n->args = keys.v;
    n->n_args = keys.n;
    n->kwargs = vals.v;
    n->n_kwargs = vals.n;
    return n;
}

static jj_node *parse_string_literal(parser *p) {
    jj_tok *at = cur(p);
    size_t total = 0;
    for (size_t k = p->pos; k < p->n_toks && p->toks[k].kind == JJ_T_STRING; k++) total += p->toks[k].len;
    char *buf = jj_arena_alloc(&p->t->arena, total + 1);
    if (!buf) return nomem(p);
    size_t off = 0;
    while (cur(p)->kind == JJ_T_STRING) {
        memcpy(buf + off, cur(p)->str, cur(p)->len);
        off += cur(p)->len;
        next(p);
    }
    json_t *j = json_stringn_nocheck(buf, total);
    if (!j) return nomem(p);
    jv v = {.kind = JV_STR};
    v.u.j = j;
    return const_node(p, at, v);
}

static jj_node *parse_primary(parser *p) {
    jj_tok *t = cur(p);
    if (!depth_enter(p)) return NULL;
    jj_node *n = NULL;
    if (t->kind == JJ_T_NAME) {
        next(p);
        if (!strcmp(t->str, "true") || !strcmp(t->str, "True")) n = const_node(p, t, jv_bool(true));
        else if (!strcmp(t->str, "false") || !strcmp(t->str, "False")) n = const_node(p, t, jv_bool(false));
        else if (!strcmp(t->str, "none") || !strcmp(t->str, "None")) n = const_node(p, t, jv_none());
        else if ((n = node_new(p, JJ_E_NAME, t)) != NULL) {
            n->str = t->str;
            n->len = t->len;
            if (!strcmp(t->str, "loop")) p->n_loop_refs++;
        }
    } else if (t->kind == JJ_T_STRING) {
        n = parse_string_literal(p);
    } else if (t->kind == JJ_T_INT) {
        next(p);
        n = const_node(p, t, jv_int(t->i));
    } else if (t->kind == JJ_T_FLOAT) {
        next(p);
        n = const_node(p, t, jv_float(t->f));
    } else if (is_op(t, JJ_TOP_LPAREN)) {
        next(p);
        n = parse_tuple(p, false, true, NULL, true);
        if (n && !expect_op(p, JJ_TOP_RPAREN, ")")) n = NULL;
    } else if (is_op(t, JJ_TOP_LBRACKET) || is_op(t, JJ_TOP_LBRACE)) {
        n = parse_list_or_dict(p, is_op(t, JJ_TOP_LBRACE));
    } else {
        n = unexpected(p);
    }
    p->depth--;
    return n;
}

static bool is_tuple_end(parser *p, const char *extra_end) {
    jj_tok *t = cur(p);
    if (t->kind == JJ_T_VAR_END || t->kind == JJ_T_BLOCK_END || is_op(t, JJ_TOP_RPAREN)) return true;
    return extra_end && is_name(t, extra_end);
}

static jj_node *parse_tuple(parser *p, bool simplified, bool with_condexpr, const char *extra_end,
                            bool explicit_parens) {
    jj_tok *at = cur(p);
    nvec items = {0};
    bool is_tuple = false;
    for (;;) {
        if (items.n && !expect_op(p, JJ_TOP_COMMA, ",")) return NULL;
        if (is_tuple_end(p, extra_end)) break;
        jj_node *e = simplified ? parse_primary(p) : parse_expression(p, with_condexpr);
        if (!e || !nvec_push(p, &items, e)) return NULL;
        if (is_op(cur(p), JJ_TOP_COMMA)) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (items.n) return items.v[0];
        if (!explicit_parens) {
            char buf[64];
            return fail_at(p, cur(p), "Expected an expression, got %s", describe(cur(p), buf, sizeof buf));
        }
    }
    jj_node *n = node_new(p, JJ_E_TUPLE, at);
    if (!n) return NULL;
    n->args = items.v;
    n->n_args = items.n;
    return n;
}

// ---- operators ------------------------------------------------------------------------------------
static jj_node *binary(parser *p, int kind, int op, const jj_tok *at, jj_node *a, jj_node *b) {
    if (!a || !b) return NULL;
    jj_node *n = node_new(p, kind, at);
    if (!n) return NULL;
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return n;
}

static jj_node *parse_unary(parser *p, bool with_filter) {
    jj_tok *t = cur(p);
    jj_node *node;
    if (!depth_enter(p)) return NULL;
    if (is_op(t, JJ_TOP_SUB) || is_op(t, JJ_TOP_ADD)) {
        next(p);
        jj_node *inner = parse_unary(p, false);
        node = inner ? node_new(p, is_op(t, JJ_TOP_SUB) ? JJ_E_NEG : JJ_E_POS, t) : NULL;
        if (node) node->a = inner;
    } else {
        node = parse_primary(p);
    }
    node = parse_postfix(p, node);
    if (with_filter) node = parse_filter_expr(p, node);
    p->depth--;
    return node;
}

static jj_node *parse_pow(parser *p) {
    jj_node *left = parse_unary(p, true);
    while (left && is_op(cur(p), JJ_TOP_POW)) {
        jj_tok *at = cur(p);
        next(p);
        left = binary(p, JJ_E_BIN, JJ_OP_POW, at, left, parse_unary(p, true));
    }
    return left;
}

static jj_node *parse_math2(parser *p) {
    jj_node *left = parse_pow(p);
    for (;;) {
        jj_tok *t = cur(p);
        int op;
        if (is_op(t, JJ_TOP_MUL)) op = JJ_OP_MUL;
        else if (is_op(t, JJ_TOP_DIV)) op = JJ_OP_DIV;
        else if (is_op(t, JJ_TOP_FLOORDIV)) op = JJ_OP_FLOORDIV;
        else if (is_op(t, JJ_TOP_MOD)) op = JJ_OP_MOD;
        else return left;
        if (!left) return NULL;
        next(p);
        left = binary(p, JJ_E_BIN, op, t, left, parse_pow(p));
    }
}

static jj_node *parse_concat(parser *p) {
    jj_tok *at = cur(p);
    jj_node *first = parse_math2(p);
    if (!first || !is_op(cur(p), JJ_TOP_TILDE)) return first;
    nvec args = {0};
    if (!nvec_push(p, &args, first)) return NULL;
    while (is_op(cur(p), JJ_TOP_TILDE)) {
        next(p);
        jj_node *e = parse_math2(p);
        if (!e || !nvec_push(p, &args, e)) return NULL;
    }
    jj_node *n = node_new(p, JJ_E_CONCAT, at);
    if (!n) return NULL;
    n->args = args.v;
    n->n_args = args.n;
    return n;
}

static jj_node *parse_math1(parser *p) {
    jj_node *left = parse_concat(p);
    while (left && (is_op(cur(p), JJ_TOP_ADD) || is_op(cur(p), JJ_TOP_SUB))) {
        jj_tok *t = cur(p);
        next(p);
        left = binary(p, JJ_E_BIN, is_op(t, JJ_TOP_ADD) ? JJ_OP_ADD : JJ_OP_SUB, t, left, parse_concat(p));
    }
    return left;
}

static int compare_op(parser *p) {
    jj_tok *t = cur(p);
    static const struct { int tok, op; } map[] = {
        {JJ_TOP_EQ, JJ_CMP_EQ}, {JJ_TOP_NE, JJ_CMP_NE}, {JJ_TOP_LT, JJ_CMP_LT},
        {JJ_TOP_LE, JJ_CMP_LE}, {JJ_TOP_GT, JJ_CMP_GT}, {JJ_TOP_GE, JJ_CMP_GE},
    };
    for (size_t k = 0; k < PD_ARRAY_LEN(map); k++)
        if (is_op(t, map[k].tok)) { next(p); return map[k].op; }
    if (is_name(t, "in")) { next(p); return JJ_CMP_IN; }
    if (is_name(t, "not") && is_name(peek(p, 1), "in")) { next(p); next(p); return JJ_CMP_NOTIN; }
    return -1;
}

static jj_node *parse_compare(parser *p) {
    jj_tok *at = cur(p);
    jj_node *expr = parse_math1(p);
    if (!expr) return NULL;
    nvec operands = {0};
    uint8_t ops[64];
    int op;
    while ((op = compare_op(p)) >= 0) {
        if (operands.n == PD_ARRAY_LEN(ops)) return fail_at(p, cur(p), "comparison chain too long%s", NULL);
        jj_node *e = parse_math1(p);
        if (!e || !nvec_push(p, &operands, e)) return NULL;
        ops[operands.n - 1] = (uint8_t)op;
    }
    if (!operands.n) return expr;
    jj_node *n = node_new(p, JJ_E_COMPARE, at);
    if (!n || !(n->ops = jj_arena_alloc(&p->t->arena, operands.n))) return nomem(p);
    memcpy(n->ops, ops, operands.n);
    n->a = expr;
    n->args = operands.v;
    n->n_args = operands.n;
    return n;
}

static jj_node *parse_not(parser *p) {
    jj_tok *t = cur(p);
    if (!is_name(t, "not")) return parse_compare(p);
    next(p);
    if (!depth_enter(p)) return NULL;
    jj_node *inner = parse_not(p);
    p->depth--;
    jj_node *n = inner ? node_new(p, JJ_E_NOT, t) : NULL;
    if (n) n->a = inner;
    return n;
}

static jj_node *parse_and(parser *p) {
    jj_node *left = parse_not(p);
    while (left && is_name(cur(p), "and")) {
        jj_tok *t = cur(p);
        next(p);
        left = binary(p, JJ_E_AND, 0, t, left, parse_not(p));
    }
    return left;
}

static jj_node *parse_or(parser *p) {
    jj_node *left = parse_and(p);
    while (left && is_name(cur(p), "or")) {
        jj_tok *t = cur(p);
        next(p);
        left = binary(p, JJ_E_OR, 0, t, left, parse_and(p));
    }
    return left;
}

static jj_node *parse_expression(parser *p, bool with_condexpr) {
    if (!depth_enter(p)) return NULL;
    jj_node *expr = parse_or(p);
    while (with_condexpr && expr && is_name(cur(p), "if")) {
        jj_tok *t = cur(p);
        next(p);
        jj_node *cond = parse_or(p), *alt = NULL;
        if (!cond) { expr = NULL; break; }
        if (is_name(cur(p), "else")) {
            next(p);
            if (!(alt = parse_expression(p, true))) { expr = NULL; break; }
        }
        jj_node *n = node_new(p, JJ_E_COND, t);
        if (!n) { expr = NULL; break; }
        n->a = cond;
        n->b = expr;
        n->c = alt;
        expr = n;
    }
    p->depth--;
    return expr;
}

// ---- statements -----------------------------------------------------------------------------------
static jj_node *subparse(parser *p, const char *const *end_names, const char *block);
static jj_node *parse_statement(parser *p);

// Expects the end of the opening tag, then parses the body up to one of end_names.
static jj_node *parse_statements(parser *p, const char *const *end_names, bool drop_needle,
                                 const char *block) {
    if (!expect_kind(p, JJ_T_BLOCK_END, "end of statement block")) return NULL;
    jj_node *body = subparse(p, end_names, block);
    if (body && drop_needle) next(p);
    return body;
}

static jj_node *parse_assign_target(parser *p, bool with_namespace, const char *extra_end) {
    jj_tok *at = cur(p);
    if (with_namespace && at->kind == JJ_T_NAME && is_op(peek(p, 1), JJ_TOP_DOT)) {
        jj_node *ns = node_new(p, JJ_E_NAME, at);
        if (!ns) return NULL;
        ns->str = at->str;
        next(p);
        next(p);
        const char *attr = expect_name(p);
        jj_node *n = attr ? node_new(p, JJ_E_NSREF, at) : NULL;
        if (!n) return NULL;
        n->a = ns;
        n->str = attr;
        n->len = strlen(attr);
        return n;
    }
    jj_node *target = parse_tuple(p, true, false, extra_end, false);
    if (!target) return NULL;
    if (target->kind == JJ_E_NAME) return target;
    if (target->kind == JJ_E_TUPLE && target->n_args > 0) {
        for (size_t k = 0; k < target->n_args; k++)
            if (target->args[k]->kind != JJ_E_NAME) return fail_at(p, at, "can't assign to this target%s", NULL);
        return target;
    }
    return fail_at(p, at, "can't assign to this target%s", NULL);
}

static jj_node *parse_for(parser *p, jj_tok *at) {
    jj_node *n = node_new(p, JJ_S_FOR, at);
    if (!n) return NULL;
    next(p);
    jj_node *target = parse_assign_target(p, false, "in");
    if (!target) return NULL;
    if (target->kind == JJ_E_NAME) {
        n->args = jj_arena_alloc(&p->t->arena, sizeof *n->args);
        if (!n->args) return nomem(p);
        n->args[0] = target;
        n->n_args = 1;
    } else {
        n->args = target->args;
        n->n_args = target->n_args;
    }
    if (!is_name(cur(p), "in")) return fail_at(p, cur(p), "expected 'in'%s", NULL);
    next(p);
    if (!(n->a = parse_tuple(p, false, false, "recursive", false))) return NULL;
    if (is_name(cur(p), "if")) {
        next(p);
        if (!(n->d = parse_expression(p, true))) return NULL;
    }
    if (is_name(cur(p), "recursive")) return fail_at(p, cur(p), "recursive loops are not supported%s", NULL);
    static const char *const ends[] = {"endfor", "else", NULL};
    static const char *const ends2[] = {"endfor", NULL};
    int refs = p->n_loop_refs;
    p->loop_depth++;
    n->b = parse_statements(p, ends, false, "for");
    p->loop_depth--;
    if (!n->b) return NULL;
    if (is_name(cur(p), "else")) {
        next(p);
        if (!(n->c = parse_statements(p, ends2, true, "for"))) return NULL;
    } else {
        next(p);
    }
    n->uses_loop = p->n_loop_refs > refs;
    return n;
}

static jj_node *parse_if(parser *p, jj_tok *at) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const ends2[] = {"endif", NULL};
    jj_node *head = node_new(p, JJ_S_IF, at), *n = head;
    if (!head) return NULL;
    next(p);
    for (;;) {
        if (!(n->a = parse_tuple(p, false, false, NULL, false))) return NULL;
        if (!(n->b = parse_statements(p, ends, false, "if"))) return NULL;
        jj_tok *t = cur(p);
        next(p);
        if (is_name(t, "elif")) {
            jj_node *elif = node_new(p, JJ_S_IF, t);
            if (!elif) return NULL;
            n->c = elif;
            n = elif;
            continue;
        }
        if (is_name(t, "else") && !(n->c = parse_statements(p, ends2, true, "if"))) return NULL;
        return head;
    }
}

static jj_node *parse_set(parser *p, jj_tok *at) {
    next(p);
    jj_node *target = parse_assign_target(p, true, NULL);
    if (!target) return NULL;
    if (is_op(cur(p), JJ_TOP_ASSIGN)) {
        next(p);
        jj_node *n = node_new(p, JJ_S_SET, at);
        if (!n) return NULL;
        n->a = target;
        n->b = parse_tuple(p, false, true, NULL, false);
        return n->b ? n : NULL;
    }
    jj_node *n = node_new(p, JJ_S_SET_BLOCK, at);
    if (!n) return NULL;
    n->a = target;
    if (is_op(cur(p), JJ_TOP_PIPE) && !(n->c = parse_filter(p, NULL, false))) return NULL;
    static const char *const ends[] = {"endset", NULL};
    n->b = parse_statements(p, ends, true, "set");
    return n->b ? n : NULL;
}

static jj_node *parse_macro(parser *p, jj_tok *at) {
    jj_node *n = node_new(p, JJ_S_MACRO, at);
    if (!n) return NULL;
    next(p);
    if (!(n->str = expect_name(p))) return NULL;
    svec names = {0};
    nvec defaults = {0};
    bool any_default = false;
    if (!expect_op(p, JJ_TOP_LPAREN, "(")) return NULL;
    while (!is_op(cur(p), JJ_TOP_RPAREN)) {
        if (names.n && !expect_op(p, JJ_TOP_COMMA, ",")) return NULL;
        if (names.n && is_op(cur(p), JJ_TOP_RPAREN)) break;
        const char *name = expect_name(p);
        jj_node *def = NULL;
        if (!name) return NULL;
        if (is_op(cur(p), JJ_TOP_ASSIGN)) {
            next(p);
            if (!(def = parse_expression(p, true))) return NULL;
            any_default = true;
        } else if (any_default) {
            return fail_at(p, cur(p), "non-default argument follows default argument%s", NULL);
        }
        if (!svec_push(p, &names, name) || !nvec_push(p, &defaults, def)) return NULL;
    }
    next(p);
    n->kwnames = names.v;
    n->kwargs = defaults.v;
    n->n_kwargs = names.n;
    static const char *const ends[] = {"endmacro", NULL};
    int loops = p->loop_depth;
    p->loop_depth = 0;
    n->a = parse_statements(p, ends, true, "macro");
    p->loop_depth = loops;
    return n->a ? n : NULL;
}

static jj_node *parse_with(parser *p, jj_tok *at) {
    jj_node *n = node_new(p, JJ_S_WITH, at);
    if (!n) return NULL;
    next(p);
    svec names = {0};
    nvec vals = {0};
    while (cur(p)->kind != JJ_T_BLOCK_END) {
        if (names.n && !expect_op(p, JJ_TOP_COMMA, ",")) return NULL;
        const char *name = expect_name(p);
        if (!name || !expect_op(p, JJ_TOP_ASSIGN, "=")) return NULL;
        jj_node *v = parse_expression(p, true);
        if (!v || !svec_push(p, &names, name) || !nvec_push(p, &vals, v)) return NULL;
    }
    n->kwnames = names.v;
    n->kwargs = vals.v;
    n->n_kwargs = names.n;
    static const char *const ends[] = {"endwith", NULL};
    n->a = parse_statements(p, ends, true, "with");
    return n->a ? n : NULL;
}

static jj_node *parse_print(parser *p, jj_tok *at) {
    jj_node *body = node_new(p, JJ_S_BODY, at);
    if (!body) return NULL;
    next(p);
    nvec items = {0};
    while (cur(p)->kind != JJ_T_BLOCK_END) {
        if (items.n && !expect_op(p, JJ_TOP_COMMA, ",")) return NULL;
        jj_node *e = parse_expression(p, true);
        jj_node *out = e ? node_new(p, JJ_S_PRINT, at) : NULL;
        if (!out) return NULL;
        out->a = e;
        if (!nvec_push(p, &items, out)) return NULL;
    }
    body->args = items.v;
    body->n_args = items.n;
    return body;
}

// Blocks whose body simply renders in place: filter, block, generation.
static jj_node *parse_simple_block(parser *p, jj_tok *at, const char *kind) {
    next(p);
    jj_node *chain = NULL;
    if (!strcmp(kind, "filter")) {
        if (!(chain = parse_filter(p, NULL, true))) return NULL;
    } else if (!strcmp(kind, "block")) {
        if (!expect_name(p)) return NULL;
        while (is_name(cur(p), "scoped") || is_name(cur(p), "required")) next(p);
    }
    const char *const ends[] = {!strcmp(kind, "filter") ? "endfilter" : !strcmp(kind, "block") ? "endblock" : "endgeneration", NULL};
    jj_node *body = parse_statements(p, ends, true, kind);
    if (!body) return NULL;
    if (!strcmp(kind, "block") && cur(p)->kind == JJ_T_NAME) next(p);
    if (!chain) return body;
    jj_node *n = node_new(p, JJ_S_FILTER, at);
    if (!n) return NULL;
    n->a = body;
    n->b = chain;
    return n;
}

static jj_node *parse_statement(parser *p) {
    jj_tok *t = cur(p);
    if (t->kind != JJ_T_NAME) return fail_at(p, t, "tag name expected%s", NULL);
    if (!depth_enter(p)) return NULL;
    jj_node *n = NULL;
    const char *name = t->str;
    if (!strcmp(name, "for")) n = parse_for(p, t);
    else if (!strcmp(name, "if")) n = parse_if(p, t);
    else if (!strcmp(name, "set")) n = parse_set(p, t);
    else if (!strcmp(name, "macro")) n = parse_macro(p, t);
    else if (!strcmp(name, "with")) n = parse_with(p, t);
    else if (!strcmp(name, "print")) n = parse_print(p, t);
    else if (!strcmp(name, "filter") || !strcmp(name, "block") || !strcmp(name, "generation"))
        n = parse_simple_block(p, t, name);
    else if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        if (!p->loop_depth) n = fail_at(p, t, "'%s' outside of a loop", name);
        else if ((n = node_new(p, !strcmp(name, "break") ? JJ_S_BREAK : JJ_S_CONTINUE, t)) != NULL) next(p);
    } else if (!strcmp(name, "call") || !strcmp(name, "include") || !strcmp(name, "import") ||
               !strcmp(name, "from") || !strcmp(name, "extends") || !strcmp(name, "autoescape") ||
               !strcmp(name, "do")) {
        n = fail_at(p, t, "the '%s' tag is not supported", name);
    } else {
        n = fail_at(p, t, "Encountered unknown tag '%s'.", name);
    }
    p->depth--;
    return n;
}

static jj_node *subparse(parser *p, const char *const *end_names, const char *block) {
    jj_node *body = node_new(p, JJ_S_BODY, cur(p));
    nvec items = {0};
    if (!body) return NULL;
    for (;;) {
        jj_tok *t = cur(p);
        jj_node *stmt = NULL;
        if (t->kind == JJ_T_DATA) {
            if (!(stmt = node_new(p, JJ_S_TEXT, t))) return NULL;
            stmt->str = t->str;
            stmt->len = t->len;
            next(p);
        } else if (t->kind == JJ_T_VAR_BEGIN) {
            next(p);
            jj_node *e = parse_tuple(p, false, true, NULL, false);
            if (!e || !expect_kind(p, JJ_T_VAR_END, "end of print statement")) return NULL;
            if (!(stmt = node_new(p, JJ_S_PRINT, t))) return NULL;
            stmt->a = e;
        } else if (t->kind == JJ_T_BLOCK_BEGIN) {
            jj_tok *name = peek(p, 1);
            for (size_t k = 0; end_names && end_names[k]; k++) {
                if (is_name(name, end_names[k])) {
                    next(p);
                    body->args = items.v;
                    body->n_args = items.n;
                    return body;
                }
            }
            next(p);
            if (!(stmt = parse_statement(p))) return NULL;
            if (!expect_kind(p, JJ_T_BLOCK_END, "end of statement block")) return NULL;
        } else if (t->kind == JJ_T_EOF) {
            if (end_names) {
                return fail_at(p, t, "Unexpected end of template. Jinja was looking for the end of the "
                                     "innermost open block, '%s'.", block);
            }
            body->args = items.v;
            body->n_args = items.n;
            return body;
        } else {
            return unexpected(p);
        }
        if (!nvec_push(p, &items, stmt)) return NULL;
    }
}

void pd_jinja_free(pd_jinja_tmpl *t) {
    if (!t) return;
    for (size_t k = 0; k < t->n_consts; k++) json_decref(t->consts[k]);
    pd_free(t->consts);
    jj_arena_fini(&t->arena);
    pd_free(t);
}

pd_jinja_tmpl *pd_jinja_parse(const char *src, size_t len, pd_err *err) {
    if (!src && len) {
        pd_err_set(err, PD_ERR_INVALID, "template source is NULL");
        return NULL;
    }
    if (!jj_utf8_valid(src ? src : "", len)) {
        pd_err_set(err, PD_ERR_INVALID, "line 1:1: template is not valid UTF-8");
        return NULL;
    }
    pd_jinja_tmpl *t = pd_calloc(1, sizeof *t);
    if (!t) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory parsing template");
        return NULL;
    }
    parser p = {.t = t, .err = err};
    if (!jj_lex(&t->arena, src ? src : "", len, &p.toks, &p.n_toks, err)) {
        pd_jinja_free(t);
        return NULL;
    }
    t->root = subparse(&p, NULL, NULL);
    if (!t->root) {
        pd_jinja_free(t);
        return NULL;
    }
    return t;
}
