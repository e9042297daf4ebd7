// jinja_impl.h — internals shared by src/tok/jinja_*.c. Not for use outside src/tok/.
//
// Pipeline: jinja_lex.c turns the source into tokens (applying whitespace control, so the parser
// never sees it), jinja_parse.c builds an AST in an arena owned by the template, jinja_eval.c walks
// it, jinja_filter.c holds the filters, tests and methods, jinja_value.c the value model (Python
// semantics over jansson values: str/repr, tojson, equality, ordering, UTF-8 helpers).
//
// Values (jv) are small tagged unions. Strings, lists and dicts are jansson json_t (reference
// counted, atomically, so values borrowed from a shared context are safe across threads); ints,
// floats and bools are inline; namespaces are a json object with their own tag; functions and loop
// objects are render-local reference-counted jj_obj. Ownership: a jv held in a variable owns one
// reference; jv_drop releases it. Values are immutable except a namespace's attributes.
//
// NOTE(jinja): a namespace stored inside a list or dict is stored as a deep copy, so json values
// never hold a namespace by reference and can never form a reference cycle (which jansson's
// reference counting would leak).
#pragma once

#include <jansson.h>
#include <stdarg.h>

#include "base/base.h"
#include "base/buf.h"
#include "tok/jinja.h"

// ---- arena: template-lifetime allocations (AST nodes, names) -----------------------------------
typedef struct jj_chunk jj_chunk;
typedef struct jj_arena {
    jj_chunk *head;  // owned list of chunks
} jj_arena;
void *jj_arena_alloc(jj_arena *a, size_t n_bytes);  // zeroed, 16-aligned; NULL on OOM
char *jj_arena_strndup(jj_arena *a, const char *s, size_t n);
void jj_arena_fini(jj_arena *a);

// ---- growable byte buffer with a size limit ---------------------------------------------------
typedef struct jj_buf {
    pd_buf s;        // the text (owned)
    size_t limit;    // put fails once len would exceed it
    bool is_nomem;   // a put failed for lack of memory
    bool is_over;    // a put failed because of limit
} jj_buf;
void jj_buf_init(jj_buf *b, size_t limit);
bool jj_buf_put(jj_buf *b, const char *s, size_t n);
bool jj_buf_putc(jj_buf *b, char c);
bool jj_buf_puts(jj_buf *b, const char *s);
bool jj_buf_printf(jj_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
char *jj_buf_take(jj_buf *b, size_t *len);  // out: owned by caller; buffer is reset
void jj_buf_fini(jj_buf *b);

// ---- values -------------------------------------------------------------------------------------
typedef enum jv_kind {
    JV_UNDEF = 0,  // u.name: the missing name (borrowed, may be NULL)
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,    // u.j: json string
    JV_LIST,   // u.j: json array (tuples are lists too)
    JV_DICT,   // u.j: json object
    JV_NS,     // u.j: json object, mutable through `set ns.attr = ...`
    JV_FUNC,   // u.o: jj_func
    JV_LOOP,   // u.o: jj_loop
} jv_kind;

typedef struct jj_obj {
    int refcount;
    uint8_t type;  // JV_FUNC or JV_LOOP
} jj_obj;

typedef struct jv {
    uint8_t kind;
    // A string borrowed from the template's constants: no reference is held (the template outlives
    // the render), so renders sharing a template never touch its reference counts.
    bool is_borrowed;
    union {
        bool b;
        int64_t i;
        double f;
        json_t *j;
        jj_obj *o;
        const char *name;
    } u;
} jv;

typedef struct jj_node jj_node;

typedef enum jj_func_kind {
    JJ_FUNC_GLOBAL = 0,  // id: jj_global
    JJ_FUNC_MACRO,       // macro: the MACRO node
    JJ_FUNC_METHOD,      // id: jj_method, self: the receiver
} jj_func_kind;

typedef struct jj_func {
    jj_obj hdr;
    uint8_t kind;
    int id;
    const jj_node *macro;  // borrowed from the template
    jv self;               // owned
} jj_func;

typedef struct jj_loop {
    jj_obj hdr;
    json_t *items;  // owned: the (filtered) sequence being iterated
    size_t index0;
    size_t length;
    int depth;
} jj_loop;

static inline jv jv_undef(const char *name) { jv v = {.kind = JV_UNDEF}; v.u.name = name; return v; }
static inline jv jv_none(void) { jv v = {.kind = JV_NONE}; return v; }
static inline jv jv_bool(bool b) { jv v = {.kind = JV_BOOL}; v.u.b = b; return v; }
static inline jv jv_int(int64_t i) { jv v = {.kind = JV_INT}; v.u.i = i; return v; }
static inline jv jv_float(double f) { jv v = {.kind = JV_FLOAT}; v.u.f = f; return v; }
static inline bool jv_is_str(const jv *v) { return v->kind == JV_STR; }
static inline bool jv_is_num(const jv *v) {
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}
static inline const char *jv_str_ptr(const jv *v) { return json_string_value(v->u.j); }
static inline size_t jv_str_len(const jv *v) { return json_string_length(v->u.j); }

void jv_drop(jv *v);        // releases v's reference; v becomes undefined
jv jv_copy(const jv *v);    // a new reference to the same value
jv jv_from_json(json_t *j); // borrowed j; NULL → undefined
jv jv_take_json(json_t *j); // takes ownership of j (NULL → none)
// A new json reference for v (NULL on OOM). Namespaces are deep-copied; undefined, functions and
// loops become null.
json_t *jv_to_json(const jv *v);
bool jv_truthy(const jv *v);
const char *jv_type_name(const jv *v);  // Python's type name, for error messages
double jv_as_double(const jv *v);        // numeric kinds only

// ---- UTF-8 ----------------------------------------------------------------------------------------
// Decodes the code point at s[*i] and advances *i. Invalid bytes decode as themselves (one byte).
uint32_t jj_utf8_next(const char *s, size_t len, size_t *i);
// Decodes the code point that ends at s[end) (end > 0) and sets *start to where it begins.
uint32_t jj_utf8_prev(const char *s, size_t end, size_t *start);
size_t jj_utf8_count(const char *s, size_t len);
size_t jj_utf8_offset(const char *s, size_t len, size_t n_cps);  // byte offset of code point n
bool jj_utf8_put(jj_buf *b, uint32_t cp);
bool jj_utf8_valid(const char *s, size_t len);
bool jj_is_space(uint32_t cp);  // Python str.isspace()
size_t jj_rstrip_len(const char *s, size_t len);  // length without trailing whitespace
size_t jj_lstrip_off(const char *s, size_t len);  // offset of the first non-whitespace byte

// ---- AST ------------------------------------------------------------------------------------------
typedef enum jj_kind {
    // statements
    JJ_S_BODY = 0,   // args: statements
    JJ_S_TEXT,       // str/len: literal output
    JJ_S_PRINT,      // a: expression
    JJ_S_IF,         // a: cond, b: body, c: else (BODY or IF) or NULL
    JJ_S_FOR,        // args: target names; a: iterable, b: body, c: else, d: filter condition
    JJ_S_SET,        // a: target (NAME, TUPLE of NAMEs, NSREF), b: value
    JJ_S_SET_BLOCK,  // a: target, b: body, c: filter chain on the body (innermost a == NULL)
    JJ_S_MACRO,      // str: name; kwnames/kwargs: parameters and defaults (NULL = none); a: body
    JJ_S_BREAK,
    JJ_S_CONTINUE,
    JJ_S_FILTER,     // a: body, b: filter chain
    JJ_S_WITH,       // kwnames/kwargs: assignments; a: body
    // expressions
    JJ_E_CONST,      // value
    JJ_E_NAME,       // str: name
    JJ_E_NSREF,      // assignment target ns.attr: a: NAME, str: attribute
    JJ_E_ATTR,       // a: object, str: attribute
    JJ_E_ITEM,       // a: object, b: key
    JJ_E_SLICE,      // a: object, b/c/d: start/stop/step (each may be NULL)
    JJ_E_CALL,       // a: callee; args; kwnames/kwargs
    JJ_E_FILTER,     // a: input (NULL: block body), op: jj_filter id; args; kwnames/kwargs
    JJ_E_TEST,       // a: input, op: jj_test id; args; kwnames/kwargs
    JJ_E_BIN,        // op: jj_binop; a, b
    JJ_E_NEG,        // a
    JJ_E_POS,        // a
    JJ_E_NOT,        // a
    JJ_E_AND,        // a, b
    JJ_E_OR,         // a, b
    JJ_E_COND,       // a: condition, b: value if true, c: value if false (NULL: undefined)
    JJ_E_COMPARE,    // a: first operand; args: further operands; ops: jj_cmpop per operand
    JJ_E_LIST,       // args
    JJ_E_TUPLE,      // args
    JJ_E_DICT,       // args: keys, kwargs: values (n_kwargs == n_args)
    JJ_E_CONCAT,     // args: operands of ~
} jj_kind;

typedef enum jj_binop {
    JJ_OP_ADD = 0, JJ_OP_SUB, JJ_OP_MUL, JJ_OP_DIV, JJ_OP_FLOORDIV, JJ_OP_MOD, JJ_OP_POW,
} jj_binop;

typedef enum jj_cmpop {
    JJ_CMP_EQ = 0, JJ_CMP_NE, JJ_CMP_LT, JJ_CMP_LE, JJ_CMP_GT, JJ_CMP_GE, JJ_CMP_IN, JJ_CMP_NOTIN,
} jj_cmpop;

struct jj_node {
    uint8_t kind;
    uint8_t op;
    bool uses_loop;  // FOR: the body or else mentions `loop`
    int line, col;
    const char *str;  // arena, NUL-terminated
    size_t len;
    jj_node *a, *b, *c, *d;
    jj_node **args;
    size_t n_args;
    const char **kwnames;
    jj_node **kwargs;
    size_t n_kwargs;
    uint8_t *ops;  // COMPARE: one per args entry
    jv value;      // CONST (owns a json reference, released by pd_jinja_free)
};

struct pd_jinja_tmpl {
    jj_arena arena;
    jj_node *root;    // BODY
    json_t **consts;  // owned references held by CONST nodes (pd_malloc'ed array)
    size_t n_consts, cap_consts;
};

// ---- lexer ----------------------------------------------------------------------------------------
typedef enum jj_tok_kind {
    JJ_T_EOF = 0,
    JJ_T_DATA,         // str/len: template text
    JJ_T_VAR_BEGIN,    // {{
    JJ_T_VAR_END,      // }}
    JJ_T_BLOCK_BEGIN,  // {%
    JJ_T_BLOCK_END,    // %}
    JJ_T_NAME,
    JJ_T_STRING,       // str/len: unescaped value
    JJ_T_INT,          // i
    JJ_T_FLOAT,        // f
    JJ_T_OP,           // op: one of the jj_tok_op values
} jj_tok_kind;

typedef enum jj_tok_op {
    JJ_TOP_ADD = 1, JJ_TOP_SUB, JJ_TOP_DIV, JJ_TOP_FLOORDIV, JJ_TOP_MUL, JJ_TOP_MOD, JJ_TOP_POW,
    JJ_TOP_TILDE, JJ_TOP_LBRACKET, JJ_TOP_RBRACKET, JJ_TOP_LPAREN, JJ_TOP_RPAREN, JJ_TOP_LBRACE,
    JJ_TOP_RBRACE, JJ_TOP_EQ, JJ_TOP_NE, JJ_TOP_GT, JJ_TOP_GE, JJ_TOP_LT, JJ_TOP_LE,
    JJ_TOP_ASSIGN, JJ_TOP_DOT, JJ_TOP_COLON, JJ_TOP_PIPE, JJ_TOP_COMMA, JJ_TOP_SEMICOLON,
} jj_tok_op;

typedef struct jj_tok {
    uint8_t kind;
    uint8_t op;
    int line, col;
    const char *str;  // arena (DATA, NAME, STRING), NUL-terminated
    size_t len;
    int64_t i;
    double f;
} jj_tok;

// Tokenizes src into *toks (arena-allocated, ends with JJ_T_EOF). false + err on error.
bool jj_lex(jj_arena *a, const char *src, size_t len, jj_tok **toks, size_t *n_toks, pd_err *err);

// ---- filters, tests, methods, globals --------------------------------------------------------------
int jj_filter_lookup(const char *name);  // -1 if unknown
int jj_test_lookup(const char *name);    // -1 if unknown
int jj_method_lookup(const jv *self, const char *name);  // -1 if self has no such method
int jj_global_lookup(const char *name);                   // -1 if unknown
const char *jj_method_name(int id);

// Render state; lives for one pd_jinja_render call on the caller's stack.
typedef struct jj_var {
    const char *name;  // borrowed (template arena or a static string)
    jv val;            // owned
} jj_var;

typedef struct jj_frame {
    struct jj_frame *parent;
    jj_var *vars;  // owned (pd_malloc)
    size_t n, cap;
} jj_frame;

typedef struct jj_render {
    const pd_jinja_tmpl *tmpl;
    json_t *ctx;  // borrowed, may be NULL
    pd_jinja_limits lim;
    jj_buf *out;  // current output (a macro call or block capture swaps in its own)
    jj_frame *root;
    uint64_t n_steps;
    int depth;
    int line;  // line of the statement/expression being evaluated
    pd_err *err;
    pd_status status;  // first error, PD_OK while all is well
} jj_render;

// Records the first error (later ones are ignored) and returns false.
bool jj_fail(jj_render *r, pd_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
bool jj_fail_nomem(jj_render *r);
// Charges cost evaluation steps; false + error once max_steps is exceeded.
bool jj_step(jj_render *r, uint64_t cost);
// Reports why a jj_buf put failed (limit or OOM) and returns false.
bool jj_fail_buf(jj_render *r, const jj_buf *b);
// A fresh string value (copied). false + error on OOM or if longer than max_output_bytes.
bool jj_str_new(jj_render *r, const char *s, size_t n, jv *out);
// Takes the buffer's bytes as a string value.
bool jj_str_from_buf(jj_render *r, jj_buf *b, jv *out);

// Arguments of a filter, test, method or function call (values owned by the caller).
typedef struct jj_args {
    jv *pos;
    size_t n_pos;
    const char **kwnames;
    jv *kw;
    size_t n_kw;
} jj_args;
// Argument by position (idx, or -1 for keyword only) or keyword name; NULL if absent.
const jv *jj_arg(const jj_args *a, int idx, const char *name);
// Fails unless the call has at most max_pos positional args and only keywords from names (NULL-ended).
bool jj_args_check(jj_render *r, const jj_args *a, const char *what, size_t max_pos,
                   const char *const *names);

bool jj_filter_apply(jj_render *r, int id, const jv *in, const jj_args *args, jv *out);
bool jj_test_apply(jj_render *r, int id, const jv *in, const jj_args *args, bool *out);
bool jj_method_call(jj_render *r, int id, const jv *self, const jj_args *args, jv *out);
// Calls any callable value (macro, global, method) — used by filters such as map.
bool jj_call_value(jj_render *r, const jv *fn, const jj_args *args, jv *out);

// Attribute (a.b) and item (a[b]) access with jinja2's fallbacks; missing → undefined.
bool jj_getattr(jj_render *r, const jv *obj, const char *name, size_t len, jv *out);
bool jj_getitem(jj_render *r, const jv *obj, const jv *key, jv *out);
// Dotted attribute path as used by map/selectattr/sort ("a.b", "0.name").
bool jj_getpath(jj_render *r, const jv *obj, const jv *path, jv *out);

// Materializes an iterable as a json array (new reference): lists as-is, dict keys, string
// characters; undefined is empty. false + error for anything else.
bool jj_iter_list(jj_render *r, const jv *v, json_t **out);

// ---- value printing and comparison (jinja_value.c) --------------------------------------------------
// str(v) as Python prints it. Appends to b; false on error (recorded in r).
bool jj_write_str(jj_render *r, jj_buf *b, const jv *v);
// repr(v) as Python prints it.
bool jj_write_repr(jj_render *r, jj_buf *b, const jv *v, int depth);
// json.dumps(v, ensure_ascii=False, indent=indent, separators=(item_sep, key_sep),
// sort_keys=sort_keys). indent NULL = single line.
typedef struct jj_json_fmt {
    const char *indent;  // NULL: no newlines
    size_t indent_len;
    const char *item_sep;
    const char *key_sep;
    bool sort_keys;
    bool ensure_ascii;   // escape non-ASCII as \uXXXX (surrogate pairs above U+FFFF)
} jj_json_fmt;
bool jj_write_json(jj_render *r, jj_buf *b, const jv *v, const jj_json_fmt *fmt);
// Python float repr ("1.0", "1e-05", "inf"). buf must hold 32 bytes.
void jj_format_float(double f, char *buf);
// Python ==.
bool jj_equal(const jv *a, const jv *b, int depth);
// Python ordering for <, <=, sort, min, max: *cmp is -1/0/1; false + error if not orderable.
bool jj_compare(jj_render *r, const jv *a, const jv *b, int *cmp);
// Lower-cased copy of a string for case-insensitive comparisons; other kinds are copied.
bool jj_fold_case(jj_render *r, const jv *v, jv *out);

// ---- string helpers shared by filters and methods (jinja_method.c) ---------------------------------
// str(v) as a string value (a copy of the reference if v is already a string).
bool jj_to_str(jj_render *r, const jv *v, jv *out);
// s.strip(chars) / lstrip / rstrip: which = 'b', 'l' or 'r'; chars NULL = whitespace.
bool jj_strip(jj_render *r, const jv *s, const jv *chars, char which, jv *out);
// s.replace(old, new, count) (count < 0: all).
bool jj_replace(jj_render *r, const jv *s, const jv *old, const jv *repl, int64_t count, jv *out);
// Case mapping (simple tables, see jinja.h): mode 'u' upper, 'l' lower, 'c' capitalize, 't' Python str.title(),
// 'j' jinja2's title filter (words start after -, whitespace, (, {, [, <).
bool jj_case(jj_render *r, const jv *s, char mode, jv *out);
// Python's printf-style `fmt % args` (args: a single value or a list of values).
bool jj_percent_format(jj_render *r, const jv *fmt, const jv *args, jv *out);
