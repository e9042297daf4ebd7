// jinja_lex.c — turns template source into tokens, the way jinja2's Lexer does with
// trim_blocks=True and lstrip_blocks=True.
//
// Whitespace control is applied here, so the parser only sees final text:
//   * `{%-`, `{{-`, `{#-` strip all whitespace (newlines included) before the tag;
//     `-%}`, `-}}`, `-#}` strip all whitespace after it.
//   * trim_blocks: the first newline after `%}` or `#}` is dropped (`+%}` keeps it).
//   * lstrip_blocks: spaces/tabs between the start of a line and `{%`/`{#` are dropped (`{%+`
//     keeps them). "Start of a line" is jinja2's rule: the text before the tag contains a newline,
//     or the previous token ended with one, or it is the start of the template.
// As in jinja2, line endings are normalized to "\n" first and one trailing newline of the template
// is dropped (keep_trailing_newline=False). "Whitespace" is Python's \s (Unicode whitespace).
//
// String literals are unescaped like Python's unicode-escape codec (\n, \t, \xNN, \uNNNN, octal,
// line continuation; unknown escapes keep their backslash). Differences: \N{...} is rejected, and
// UTF-16 surrogate escapes are paired into one code point (a lone one becomes U+FFFD) because the
// output must be valid UTF-8.
#include <stdlib.h>
#include <string.h>

#include "tok/jinja_impl.h"

typedef struct lexer {
    jj_arena *arena;
    const char *src;  // normalized source (pd_malloc'ed)
    size_t n;
    size_t pos;
    int line;          // line of line_pos
    size_t line_pos;   // position up to which newlines were counted
    size_t line_begin; // start of the line containing line_pos
    bool line_starting;
    int depth;         // open brackets inside the current tag
    char stack[256];
    jj_tok *toks;      // pd_malloc'ed while lexing
    size_t n_toks, cap_toks;
    pd_err *err;
} lexer;

static void where(lexer *lx, size_t pos, int *line, int *col) {
    while (lx->line_pos < pos) {
        if (lx->src[lx->line_pos] == '\n') {
            lx->line++;
            lx->line_begin = lx->line_pos + 1;
        }
        lx->line_pos++;
    }
    *line = lx->line;
    *col = (int)(pos - lx->line_begin) + 1;
}

static bool fail(lexer *lx, size_t pos, const char *msg, const char *arg) {
    int line, col;
    if (pos < lx->line_pos) pos = lx->line_pos;
    where(lx, pos, &line, &col);
    pd_err_set(lx->err, PD_ERR_INVALID, "line %d:%d: %s%s", line, col, msg, arg ? arg : "");
    return false;
}

static bool nomem(lexer *lx) {
    pd_err_set(lx->err, PD_ERR_NOMEM, "out of memory parsing template");
    return false;
}

static jj_tok *push(lexer *lx, uint8_t kind, size_t pos) {
    if (PD_ARRAY_RESERVE(lx->toks, lx->cap_toks, lx->n_toks + 1) != PD_OK) return NULL;
    jj_tok *t = &lx->toks[lx->n_toks++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    where(lx, pos, &t->line, &t->col);
    return t;
}

static bool push_str(lexer *lx, uint8_t kind, size_t pos, const char *s, size_t len) {
    jj_tok *t = push(lx, kind, pos);
    if (!t) return nomem(lx);
    t->str = jj_arena_strndup(lx->arena, s, len);
    t->len = len;
    return t->str ? true : nomem(lx);
}

// Length of the Python-\s whitespace run at p.
static size_t space_run(const lexer *lx, size_t p) {
    size_t i = p;
    while (i < lx->n) {
        size_t at = i;
        if (!jj_is_space(jj_utf8_next(lx->src, lx->n, &i))) return at - p;
    }
    return i - p;
}

static bool starts(const lexer *lx, size_t p, const char *s) {
    size_t k = strlen(s);
    return p + k <= lx->n && !memcmp(lx->src + p, s, k);
}

// Emits the text before a tag, applying `-` stripping or lstrip_blocks.
static bool emit_text(lexer *lx, size_t from, size_t to, char sign, bool can_lstrip) {
    const char *text = lx->src + from;
    size_t len = to - from;
    if (sign == '-') {
        len = jj_rstrip_len(text, len);
    } else if (sign != '+' && can_lstrip) {
        size_t l_pos = 0;
        for (size_t k = len; k > 0; k--)
            if (text[k - 1] == '\n') { l_pos = k; break; }
        if ((l_pos > 0 || lx->line_starting) && l_pos < len &&
            jj_rstrip_len(text + l_pos, len - l_pos) == 0)
            len = l_pos;
    }
    return len ? push_str(lx, JJ_T_DATA, from, text, len) : true;
}

// ---- string literals ------------------------------------------------------------------------------
static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool read_hex(const char *s, size_t len, size_t i, int n, uint32_t *cp) {
    uint32_t v = 0;
    if (i + (size_t)n > len) return false;
    for (int k = 0; k < n; k++) {
        int h = hex_val(s[i + (size_t)k]);
        if (h < 0) return false;
        v = v * 16 + (uint32_t)h;
    }
    *cp = v;
    return true;
}

// One backslash escape at s[i] (the character after the backslash). Appends to b, advances *i.
static bool unescape_one(lexer *lx, size_t pos, const char *s, size_t len, size_t *i, jj_buf *b) {
    char c = s[*i];
    static const char simple_in[] = "\\'\"abfnrtv", simple_out[] = "\\'\"\a\b\f\n\r\t\v";
    const char *hit = strchr(simple_in, c);
    if (c && hit) {
        (*i)++;
        return jj_buf_putc(b, simple_out[hit - simple_in]);
    }
    if (c == '\n') { (*i)++; return true; }
    if (c >= '0' && c <= '7') {
        uint32_t v = 0;
        for (int k = 0; k < 3 && *i < len && s[*i] >= '0' && s[*i] <= '7'; k++) v = v * 8 + (uint32_t)(s[(*i)++] - '0');
        return jj_utf8_put(b, v);
    }
    if (c == 'x' || c == 'u' || c == 'U') {
        int n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        uint32_t cp;
        if (!read_hex(s, len, *i + 1, n, &cp)) return fail(lx, pos, "truncated escape in string literal", NULL);
        *i += 1 + (size_t)n;
        if (cp > 0x10FFFF) return fail(lx, pos, "illegal Unicode character in string literal", NULL);
        if (cp >= 0xD800 && cp <= 0xDBFF && *i + 6 <= len && s[*i] == '\\' && s[*i + 1] == 'u') {
            uint32_t lo;
            if (read_hex(s, len, *i + 2, 4, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                *i += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;
        return jj_utf8_put(b, cp);
    }
    if (c == 'N') return fail(lx, pos, "\\N{...} escapes are not supported", NULL);
    if ((unsigned char)c >= 0x80) {
        // Python backslash-replaces the character first: "\é" becomes "\\xe9", decoded as "\xe9".
        uint32_t cp = jj_utf8_next(s, len, i);
        if (cp < 0x100) return jj_buf_printf(b, "\\x%02x", cp);
        if (cp < 0x10000) return jj_buf_printf(b, "\\u%04x", cp);
        return jj_buf_printf(b, "\\U%08x", cp);
    }
    (*i)++;
    return jj_buf_putc(b, '\\') && jj_buf_putc(b, c);
}

static bool lex_string(lexer *lx, size_t *p) {
    size_t start = *p;
    char q = lx->src[start];
    size_t i = start + 1;
    while (i < lx->n && lx->src[i] != q) i += (lx->src[i] == '\\' && i + 1 < lx->n) ? 2 : 1;
    if (i >= lx->n) return fail(lx, start, "unexpected char ", q == '"' ? "'\"'" : "\"'\"");
    const char *s = lx->src + start + 1;
    size_t len = i - start - 1;
    jj_buf b;
    jj_buf_init(&b, (size_t)-1);
    size_t k = 0;
    bool ok = true;
    while (ok && k < len) {
        if (s[k] == '\\' && k + 1 < len) {
            k++;
            ok = unescape_one(lx, start, s, len, &k, &b);
        } else {
            ok = jj_buf_putc(&b, s[k++]);
        }
    }
    if (ok) ok = push_str(lx, JJ_T_STRING, start, b.s.p ? b.s.p : "", b.s.len);
    else if (b.is_nomem) nomem(lx);
    jj_buf_fini(&b);
    *p = i + 1;
    return ok;
}

// ---- numbers --------------------------------------------------------------------------------------
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Digits with single '_' separators ((\d+_)*\d+) at p; returns the length, 0 if none.
static size_t digit_run(const lexer *lx, size_t p) {
    size_t i = p;
    if (i >= lx->n || !is_digit(lx->src[i])) return 0;
    while (i < lx->n) {
        if (is_digit(lx->src[i])) i++;
        else if (lx->src[i] == '_' && i + 1 < lx->n && is_digit(lx->src[i + 1])) i++;
        else break;
    }
    return i - p;
}

static size_t float_len(const lexer *lx, size_t p) {
    if (p > 0 && lx->src[p - 1] == '.') return 0;
    size_t i = p + digit_run(lx, p);
    if (i == p) return 0;
    size_t frac = 0;
    if (i < lx->n && lx->src[i] == '.') frac = digit_run(lx, i + 1);
    size_t after_frac = frac ? i + 1 + frac : i;
    if (after_frac < lx->n && (lx->src[after_frac] == 'e' || lx->src[after_frac] == 'E')) {
        size_t e = after_frac + 1;
        if (e < lx->n && (lx->src[e] == '+' || lx->src[e] == '-')) e++;
        size_t ed = digit_run(lx, e);
        if (ed) return e + ed - p;
    }
    return frac ? after_frac - p : 0;
}

static bool lex_number(lexer *lx, size_t *p) {
    size_t start = *p, n = float_len(lx, start);
    char buf[64];
    size_t k = 0;
    if (n) {
        for (size_t i = start; i < start + n && k < sizeof buf - 1; i++)
            if (lx->src[i] != '_') buf[k++] = lx->src[i];
        buf[k] = 0;
        jj_tok *t = push(lx, JJ_T_FLOAT, start);
        if (!t) return nomem(lx);
        t->f = strtod(buf, NULL);
        *p = start + n;
        return true;
    }
    int base = 10;
    size_t i = start, digits_start = start;
    char c0 = lx->src[start], c1 = start + 1 < lx->n ? lx->src[start + 1] : 0;
    if (c0 == '0' && c1 && strchr("bBoOxX", c1)) {
        int b = (c1 == 'b' || c1 == 'B') ? 2 : (c1 == 'o' || c1 == 'O') ? 8 : 16;
        size_t j = start + 2, end = 0;
        for (;;) {
            size_t d = j < lx->n && lx->src[j] == '_' ? j + 1 : j;
            if (d >= lx->n || hex_val(lx->src[d]) < 0 || hex_val(lx->src[d]) >= b) break;
            j = end = d + 1;
        }
        if (end) {
            base = b;
            digits_start = start + 2;
            i = end;
        }
    }
    if (i == start) {
        // [1-9](_?\d)* or 0(_?0)*
        char want_max = c0 == '0' ? '0' : '9';
        i = start + 1;
        for (;;) {
            size_t d = i < lx->n && lx->src[i] == '_' ? i + 1 : i;
            if (d >= lx->n || lx->src[d] < '0' || lx->src[d] > want_max) break;
            i = d + 1;
        }
    }
    uint64_t v = 0;
    for (size_t j = digits_start; j < i; j++) {
        if (lx->src[j] == '_') continue;
        uint64_t d = (uint64_t)hex_val(lx->src[j]);
        if (v > (UINT64_MAX - d) / (uint64_t)base || v * (uint64_t)base + d > (uint64_t)INT64_MAX)
            return fail(lx, start, "integer literal too large", NULL);
        v = v * (uint64_t)base + d;
    }
    jj_tok *t = push(lx, JJ_T_INT, start);
    if (!t) return nomem(lx);
    t->i = (int64_t)v;
    *p = i;
    return true;
}

// ---- operators ------------------------------------------------------------------------------------
static int lex_op(const lexer *lx, size_t p, size_t *len) {
    static const struct { const char *s; int op; } ops[] = {
        {"//", JJ_TOP_FLOORDIV}, {"**", JJ_TOP_POW}, {"==", JJ_TOP_EQ}, {"!=", JJ_TOP_NE},
        {">=", JJ_TOP_GE}, {"<=", JJ_TOP_LE}, {"+", JJ_TOP_ADD}, {"-", JJ_TOP_SUB},
        {"/", JJ_TOP_DIV}, {"*", JJ_TOP_MUL}, {"%", JJ_TOP_MOD}, {"~", JJ_TOP_TILDE},
        {"[", JJ_TOP_LBRACKET}, {"]", JJ_TOP_RBRACKET}, {"(", JJ_TOP_LPAREN}, {")", JJ_TOP_RPAREN},
        {"{", JJ_TOP_LBRACE}, {"}", JJ_TOP_RBRACE}, {">", JJ_TOP_GT}, {"<", JJ_TOP_LT},
        {"=", JJ_TOP_ASSIGN}, {".", JJ_TOP_DOT}, {":", JJ_TOP_COLON}, {"|", JJ_TOP_PIPE},
        {",", JJ_TOP_COMMA}, {";", JJ_TOP_SEMICOLON},
    };
    for (size_t k = 0; k < PD_ARRAY_LEN(ops); k++) {
        if (starts(lx, p, ops[k].s)) {
            *len = strlen(ops[k].s);
            return ops[k].op;
        }
    }
    return 0;
}

static bool balance(lexer *lx, size_t p, char c) {
    if (c == '{' || c == '(' || c == '[') {
        if (lx->depth >= (int)sizeof lx->stack) return fail(lx, p, "brackets nested too deeply", NULL);
        lx->stack[lx->depth++] = c == '{' ? '}' : c == '(' ? ')' : ']';
        return true;
    }
    if (c != '}' && c != ')' && c != ']') return true;
    char got[4] = {'\'', c, '\'', 0};
    if (lx->depth == 0) return fail(lx, p, "unexpected ", got);
    char want = lx->stack[--lx->depth];
    if (want != c) {
        char msg[48];
        snprintf(msg, sizeof msg, "'%c', expected '%c'", c, want);
        return fail(lx, p, "unexpected ", msg);
    }
    return true;
}

// Matches a tag end at p (only when brackets are balanced). Returns its length incl. stripping.
static size_t tag_end(lexer *lx, size_t p, bool is_block) {
    const char *close = is_block ? "%}" : "}}";
    if (lx->depth) return 0;
    if (is_block && lx->src[p] == '+' && starts(lx, p + 1, close)) return 3;
    if (lx->src[p] == '-' && starts(lx, p + 1, close)) return 3 + space_run(lx, p + 3);
    if (starts(lx, p, close)) return (is_block && p + 2 < lx->n && lx->src[p + 2] == '\n') ? 3 : 2;
    return 0;
}

static bool lex_tag(lexer *lx, size_t *pp, bool is_block) {
    size_t p = *pp;
    lx->depth = 0;
    for (;;) {
        if (p >= lx->n) return fail(lx, p, "unexpected end of template, missing ", is_block ? "'%}'" : "'}}'");
        size_t end = tag_end(lx, p, is_block);
        if (end) {
            if (!push(lx, is_block ? JJ_T_BLOCK_END : JJ_T_VAR_END, p)) return nomem(lx);
            p += end;
            lx->line_starting = lx->src[p - 1] == '\n';
            break;
        }
        char c = lx->src[p];
        size_t len;
        int op;
        size_t ws = space_run(lx, p);
        if (ws) {
            p += ws;
        } else if (is_digit(c)) {
            if (!lex_number(lx, &p)) return false;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t s = p;
            while (p < lx->n && ((lx->src[p] >= 'a' && lx->src[p] <= 'z') ||
                                 (lx->src[p] >= 'A' && lx->src[p] <= 'Z') || is_digit(lx->src[p]) ||
                                 lx->src[p] == '_'))
                p++;
            if (!push_str(lx, JJ_T_NAME, s, lx->src + s, p - s)) return false;
        } else if (c == '\'' || c == '"') {
            if (!lex_string(lx, &p)) return false;
        } else if ((op = lex_op(lx, p, &len)) != 0) {
            if (!balance(lx, p, c)) return false;
            jj_tok *t = push(lx, JJ_T_OP, p);
            if (!t) return nomem(lx);
            t->op = (uint8_t)op;
            p += len;
        } else {
            char got[8] = {'\'', c, '\'', 0};
            return fail(lx, p, "unexpected char ", got);
        }
    }
    *pp = p;
    return true;
}

static bool lex_comment(lexer *lx, size_t *pp) {
    size_t p = *pp;
    for (size_t q = p; q + 1 < lx->n; q++) {
        if (lx->src[q] != '#' || lx->src[q + 1] != '}') continue;
        char sign = (q > p && (lx->src[q - 1] == '-' || lx->src[q - 1] == '+')) ? lx->src[q - 1] : 0;
        size_t e = q + 2;
        if (sign == '-') e += space_run(lx, e);
        else if (!sign && e < lx->n && lx->src[e] == '\n') e++;
        lx->line_starting = lx->src[e - 1] == '\n';
        *pp = e;
        return true;
    }
    return fail(lx, p, "Missing end of comment tag", NULL);
}

// `{%` [-+] \s* raw \s* (-%} \s* | %}) at the position after `{%`; returns the end or 0.
static size_t raw_begin(lexer *lx, size_t p) {
    if (p < lx->n && (lx->src[p] == '-' || lx->src[p] == '+')) p++;
    p += space_run(lx, p);
    if (!starts(lx, p, "raw")) return 0;
    p += 3 + space_run(lx, p + 3);
    if (starts(lx, p, "-%}")) return p + 3 + space_run(lx, p + 3);
    if (starts(lx, p, "%}")) return p + 2;
    return 0;
}

static bool lex_raw(lexer *lx, size_t *pp) {
    size_t p = *pp;
    for (size_t q = p; q + 1 < lx->n; q++) {
        if (lx->src[q] != '{' || lx->src[q + 1] != '%') continue;
        size_t e = q + 2;
        char sign = (e < lx->n && (lx->src[e] == '-' || lx->src[e] == '+')) ? lx->src[e] : 0;
        if (sign) e++;
        e += space_run(lx, e);
        if (!starts(lx, e, "endraw")) continue;
        e += 6 + space_run(lx, e + 6);
        if (starts(lx, e, "+%}")) e += 3;
        else if (starts(lx, e, "-%}")) e += 3 + space_run(lx, e + 3);
        else if (starts(lx, e, "%}")) e += (e + 2 < lx->n && lx->src[e + 2] == '\n') ? 3 : 2;
        else continue;
        if (!emit_text(lx, p, q, sign, true)) return false;
        lx->line_starting = lx->src[e - 1] == '\n';
        *pp = e;
        return true;
    }
    return fail(lx, p, "Missing end of raw directive", NULL);
}

static bool lex_all(lexer *lx) {
    while (lx->pos < lx->n) {
        size_t t = lx->pos;
        while (t + 1 < lx->n && !(lx->src[t] == '{' && strchr("{%#", lx->src[t + 1]) && lx->src[t + 1]))
            t++;
        if (t + 1 >= lx->n) {
            if (!push_str(lx, JJ_T_DATA, lx->pos, lx->src + lx->pos, lx->n - lx->pos)) return false;
            break;
        }
        char kind = lx->src[t + 1];
        size_t p = t + 2;
        char sign = (p < lx->n && (lx->src[p] == '-' || lx->src[p] == '+')) ? lx->src[p] : 0;
        size_t raw_end = kind == '%' ? raw_begin(lx, p) : 0;
        if (sign) p++;
        if (!emit_text(lx, lx->pos, t, sign, kind != '{')) return false;
        lx->line_starting = false;
        if (raw_end) {
            lx->line_starting = lx->src[raw_end - 1] == '\n';
            p = raw_end;
            if (!lex_raw(lx, &p)) return false;
        } else if (kind == '#') {
            if (!lex_comment(lx, &p)) return false;
        } else {
            if (!push(lx, kind == '%' ? JJ_T_BLOCK_BEGIN : JJ_T_VAR_BEGIN, t)) return nomem(lx);
            if (!lex_tag(lx, &p, kind == '%')) return false;
        }
        lx->pos = p;
    }
    return push(lx, JJ_T_EOF, lx->n) ? true : nomem(lx);
}

bool jj_lex(jj_arena *a, const char *src, size_t len, jj_tok **toks, size_t *n_toks, pd_err *err) {
    // Normalize \r\n and \r to \n, then drop one trailing newline.
    char *norm = pd_malloc(len + 1);
    if (!norm) return pd_err_set(err, PD_ERR_NOMEM, "out of memory parsing template"), false;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n > 0 && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    lexer lx = {.arena = a, .src = norm, .n = n, .line = 1, .line_starting = true, .err = err};
    bool ok = lex_all(&lx);
    if (ok) {
        *toks = jj_arena_alloc(a, lx.n_toks * sizeof **toks);
        if (*toks) {
            memcpy(*toks, lx.toks, lx.n_toks * sizeof **toks);
            *n_toks = lx.n_toks;
        } else {
            ok = nomem(&lx);
        }
    }
    pd_free(lx.toks);
    pd_free(norm);
    return ok;
}
