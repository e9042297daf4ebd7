// tok.c — loading a Hugging Face tokenizer.json (+ tokenizer_config.json) into a pd_tok, and the
// read-only accessors.
//
// Loading turns the JSON into flat tables (see tok_impl.h): the token table indexed by id, hash
// maps for the vocabulary, the added tokens and the merges, the added-token tries, and the
// normalizer / pre-tokenizer / decoder pipelines with nested Sequences flattened. Every
// component type is checked: anything not implemented fails the load with PD_ERR_UNSUPPORTED
// naming it, rather than silently tokenizing differently from HF.
//
// Semantics follow HF tokenizers 0.23 (the reference the golden tests were made with):
//   * merges: rank = position in the list; a repeated pair keeps its last rank (HF builds its
//     merge map by inserting in order);
//   * the id → string table prefers an added token's content over the model's string
//     (AddedVocabulary::simple_id_to_token first); a normalized added token is reported, and
//     decoded, by its normalized content ("foo bar" → "▁foo▁bar" under Llama 2's normalizer),
//     as tokenizers 0.23 does;
//   * a token is "special" when its string is the content of a special added token.
// NOT handled: BPE dropout, continuing_subword_prefix / end_of_word_suffix, pair templates
// (only the single-sequence template is used), truncation and padding (ignored), and vocabulary
// keys containing U+0000 (jansson refuses NUL in object keys: the load fails as bad JSON).
#include <jansson.h>
#include <string.h>

#include "tok/tok_impl.h"

#define TJ "tokenizer.json"

// ---- small helpers -------------------------------------------------------------------------------

static void *gctx_malloc(PCRE2_SIZE n, void *ud) {
    PD_UNUSED(ud);
    return pd_malloc(n);
}
static void gctx_free(void *p, void *ud) {
    PD_UNUSED(ud);
    pd_free(p);
}

// Appends s[0..n) + NUL to the pool; returns its offset, or -1 on OOM / overflow.
static int64_t pool_add(pd_tok *t, const char *s, size_t n) {
    if (n > UINT32_MAX / 2 || t->pool_len + n + 1 > UINT32_MAX) return -1;
    if (PD_ARRAY_RESERVE(t->pool, t->pool_cap, PD_MAX(t->pool_len + n + 1, 4096)) != PD_OK) return -1;
    int64_t off = (int64_t)t->pool_len;
    if (n) memcpy(t->pool + t->pool_len, s, n);
    t->pool[t->pool_len + n] = 0;
    t->pool_len += n + 1;
    return off;
}

static const char *jstr(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool jbool(json_t *o, const char *key, bool dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

static pd_status nomem(pd_err *err) { return pd_err_set(err, PD_ERR_NOMEM, "tokenizer: out of memory"); }

// Reads and parses a JSON file. A missing optional file gives PD_OK with *out = NULL.
static pd_status load_json(const char *dir, const char *name, bool optional, json_t **out,
                           pd_err *err) {
    *out = NULL;
    char *path = pd_path_join(dir, name);
    if (!path) return nomem(err);
    char *text = NULL;
    size_t len = 0;
    pd_err ferr = {0};
    pd_status st = pd_file_read_all(path, &text, &len, &ferr);
    if (st == PD_ERR_NOTFOUND && optional) {
        pd_free(path);
        return PD_OK;
    }
    if (st != PD_OK) {
        pd_err_set(err, st, "cannot load tokenizer: %s%s", ferr.msg,
                   st == PD_ERR_NOTFOUND ? " (no " TJ " in the model folder?)" : "");
        pd_free(path);
        return st;
    }
    json_error_t je;
    *out = json_loadb(text, len, JSON_ALLOW_NUL, &je);
    pd_free(text);
    if (!*out) {
        st = pd_err_set(err, PD_ERR_PROTO, "%s: bad JSON at line %d column %d: %s", path, je.line,
                        je.column, je.text);
    }
    pd_free(path);
    return st;
}

static pcre2_code *re_compile(pd_tok *t, const char *pat, size_t n, bool literal,
                              const char *what, pd_err *err) {
    pcre2_compile_context *cc = pcre2_compile_context_create(t->gctx);
    if (!cc) {
        nomem(err);
        return NULL;
    }
    int ec;
    PCRE2_SIZE eo;
    // PCRE2_LITERAL refuses PCRE2_UCP (which only matters for \w, \s, ... anyway).
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, opts, &ec, &eo, cc);
    pcre2_compile_context_free(cc);
    if (!re && ec == PCRE2_ERROR_HEAP_FAILED) {
        nomem(err);
        return NULL;
    }
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof(msg));
        pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": %s: cannot compile regex '%.200s': %s (offset %zu)",
                   what, pat, (const char *)msg, (size_t)eo);
        return NULL;
    }
    // JIT is an optimisation: without it (or on a JIT error at match time) the interpreter runs.
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}

// Pattern object {"Regex": "..."} or {"String": "..."}.
static pcre2_code *pattern_compile(pd_tok *t, json_t *pat, const char *what, pd_err *err) {
    json_t *v = json_object_get(pat, "Regex");
    bool literal = false;
    if (!json_is_string(v)) {
        v = json_object_get(pat, "String");
        literal = true;
    }
    if (!json_is_string(v)) {
        pd_err_set(err, PD_ERR_PROTO, TJ ": %s: pattern is neither {\"Regex\"} nor {\"String\"}", what);
        return NULL;
    }
    return re_compile(t, json_string_value(v), json_string_length(v), literal, what, err);
}

// ---- model: vocabulary, added tokens, merges ------------------------------------------------

static pd_status set_token_str(pd_tok *t, int32_t id, const char *s, size_t n, pd_err *err) {
    int64_t off = pool_add(t, s, n);
    if (off < 0) return nomem(err);
    t->tokens[id].str_off = (uint32_t)off;
    t->tokens[id].str_len = (uint32_t)n;
    return PD_OK;
}

// Finds the largest id in the vocabulary and the added tokens, allocates the tables.
static pd_status alloc_tables(pd_tok *t, json_t *vocab, json_t *added, pd_err *err) {
    int64_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 26)) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": model.vocab[\"%.100s\"] is not a valid id", key);
        }
        max_id = PD_MAX(max_id, (int64_t)json_integer_value(v));
    }
    size_t i;
    json_array_foreach(added, i, v) {
        json_t *id = json_object_get(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= (1 << 26)) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": added_tokens[%zu].id is not a valid id", i);
        }
        max_id = PD_MAX(max_id, (int64_t)json_integer_value(id));
    }
    t->n_vocab = (int)(max_id + 1);
    size_t n = (size_t)t->n_vocab + 1;
    t->tokens = pd_calloc(n, sizeof(*t->tokens));
    t->str_off = pd_calloc(n, sizeof(*t->str_off));
    t->str_len = pd_calloc(n, sizeof(*t->str_len));
    t->added_key_off = pd_calloc(n, sizeof(*t->added_key_off));
    t->added_key_len = pd_calloc(n, sizeof(*t->added_key_len));
    if (!t->tokens || !t->str_off || !t->str_len || !t->added_key_off || !t->added_key_len) return nomem(err);
    return PD_OK;
}

static pd_status load_vocab(pd_tok *t, json_t *vocab, pd_err *err) {
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        if (t->tokens[id].flags & PD_TOK_TF_MODEL) {
            PD_LOG_W("tokenizer: id %d has two strings in model.vocab; keeping the first", id);
            continue;
        }
        pd_status st = set_token_str(t, id, key, strlen(key), err);
        if (st != PD_OK) return st;
        t->tokens[id].flags |= PD_TOK_TF_MODEL;
        t->str_off[id] = t->tokens[id].str_off;
        t->str_len[id] = t->tokens[id].str_len;
        if (pd_tok_smap_put(&t->vocab, t->pool, t->str_off, t->str_len, id) != PD_OK) return nomem(err);
    }
    return PD_OK;
}

static pd_status load_added(pd_tok *t, json_t *added, pd_err *err) {
    size_t n = json_array_size(added), i;
    t->added = pd_calloc(n ? n : 1, sizeof(*t->added));
    if (!t->added) return nomem(err);
    json_t *v;
    json_array_foreach(added, i, v) {
        json_t *content = json_object_get(v, "content");
        if (!json_is_string(content)) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": added_tokens[%zu].content is not a string", i);
        }
        const char *s = json_string_value(content);
        size_t len = json_string_length(content);
        int32_t id = (int32_t)json_integer_value(json_object_get(v, "id"));
        if (len == 0) continue;  // HF ignores empty added tokens
        pd_tok_added *a = &t->added[t->n_added++];
        a->id = id;
        a->special = jbool(v, "special", false);
        a->lstrip = jbool(v, "lstrip", false);
        a->rstrip = jbool(v, "rstrip", false);
        a->single_word = jbool(v, "single_word", false);
        a->normalized = jbool(v, "normalized", !a->special);
        pd_status st = set_token_str(t, id, s, len, err);
        if (st != PD_OK) return st;
        a->off = t->tokens[id].str_off;
        a->len = (uint32_t)len;
        t->tokens[id].flags |= PD_TOK_TF_ADDED;
        t->added_key_off[id] = a->off;
        t->added_key_len[id] = a->len;
        if (pd_tok_smap_put(&t->added_map, t->pool, t->added_key_off, t->added_key_len, id) != PD_OK) {
            return nomem(err);
        }
    }
    // "special" is a property of the string (HF special_tokens_set): mark every id whose string
    // is a special token's content, model-vocabulary twins included.
    for (int k = 0; k < t->n_added; k++) {
        pd_tok_added *a = &t->added[k];
        if (!a->special) continue;
        t->tokens[a->id].flags |= PD_TOK_TF_SPECIAL;
        int32_t mid = pd_tok_smap_get(&t->vocab, t->pool, t->str_off, t->str_len, t->pool + a->off, a->len);
        if (mid >= 0 && !(t->tokens[mid].flags & PD_TOK_TF_ADDED)) t->tokens[mid].flags |= PD_TOK_TF_SPECIAL;
    }
    return PD_OK;
}

static int32_t vocab_id(const pd_tok *t, const char *s, size_t n) {
    return pd_tok_smap_get(&t->vocab, t->pool, t->str_off, t->str_len, s, n);
}

static pd_status load_merges(pd_tok *t, json_t *merges, pd_err *err) {
    size_t i;
    json_t *m;
    pd_buf joined = {0};
    pd_status st = PD_OK;
    json_array_foreach(merges, i, m) {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {  // legacy "a b"
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                st = pd_err_set(err, PD_ERR_PROTO, TJ ": merge %zu \"%.100s\" is not \"a b\"", i, s);
                break;
            }
            a = s, la = (size_t)(sp - s), b = sp + 1, lb = strlen(sp + 1);
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0)), la = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1)), lb = json_string_length(json_array_get(m, 1));
        } else {
            st = pd_err_set(err, PD_ERR_PROTO, TJ ": merge %zu is neither \"a b\" nor [\"a\", \"b\"]", i);
            break;
        }
        int32_t ia = vocab_id(t, a, la), ib = vocab_id(t, b, lb);
        joined.len = 0;
        if (pd_buf_append(&joined, a, la) != PD_OK || pd_buf_append(&joined, b, lb) != PD_OK) {
            st = nomem(err);
            break;
        }
        int32_t inew = vocab_id(t, joined.p, joined.len);
        if (ia < 0 || ib < 0 || inew < 0) {
            st = pd_err_set(err, PD_ERR_PROTO, TJ ": merge %zu (\"%.60s\" \"%.60s\"): token \"%.120s\" not in the vocabulary",
                            i, a, b, ia < 0 ? a : ib < 0 ? b : joined.p);
            break;
        }
        if (pd_tok_pmap_put(&t->merges, ia, ib, (int32_t)i, inew) != PD_OK) {
            st = nomem(err);
            break;
        }
    }
    pd_buf_free(&joined);
    return st;
}

static pd_status load_model(pd_tok *t, json_t *root, pd_err *err) {
    json_t *model = json_object_get(root, "model");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(model)) return pd_err_set(err, PD_ERR_PROTO, TJ ": no \"model\" object");
    const char *type = jstr(model, "type");
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    if (!type && json_is_object(vocab) && json_is_array(merges)) type = "BPE";  // very old files
    if (!type || strcmp(type, "BPE") != 0) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": model type '%s' is not supported (only BPE)",
                          type ? type : "(none)");
    }
    if (!json_is_object(vocab) || !json_is_array(merges)) {
        return pd_err_set(err, PD_ERR_PROTO, TJ ": BPE model needs \"vocab\" (object) and \"merges\" (array)");
    }
    if (added && !json_is_array(added)) return pd_err_set(err, PD_ERR_PROTO, TJ ": added_tokens is not an array");
    json_t *dropout = json_object_get(model, "dropout");
    if (json_is_number(dropout) && json_number_value(dropout) > 0) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": BPE dropout is not supported");
    }
    if (jstr(model, "continuing_subword_prefix") || jstr(model, "end_of_word_suffix")) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          TJ ": BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    }
    t->fuse_unk = jbool(model, "fuse_unk", false);
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);

    pd_status st = alloc_tables(t, vocab, added, err);
    if (st == PD_OK) st = load_vocab(t, vocab, err);
    if (st == PD_OK) st = load_added(t, added, err);
    if (st == PD_OK) st = load_merges(t, merges, err);
    if (st != PD_OK) return st;

    t->unk_id = -1;
    const char *unk = jstr(model, "unk_token");
    if (unk) {
        t->unk_id = vocab_id(t, unk, strlen(unk));
        if (t->unk_id < 0) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": unk_token \"%.100s\" is not in the vocabulary", unk);
        }
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        t->byte_ids[b] = vocab_id(t, name, 6);
    }
    return PD_OK;
}

// ---- normalizer / pre-tokenizer / decoder / post-processor ------------------------------------

static pd_status too_many(pd_err *err, const char *what) {
    return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": more than %d %s steps", PD_TOK_MAX_STEPS, what);
}

static pd_status str_field(pd_tok *t, json_t *o, const char *key, const char *what, uint32_t *off,
                           uint32_t *len, pd_err *err) {
    json_t *v = json_object_get(o, key);
    if (!json_is_string(v)) return pd_err_set(err, PD_ERR_PROTO, TJ ": %s needs a string \"%s\"", what, key);
    int64_t o2 = pool_add(t, json_string_value(v), json_string_length(v));
    if (o2 < 0) return nomem(err);
    *off = (uint32_t)o2;
    *len = (uint32_t)json_string_length(v);
    return PD_OK;
}

static pd_status load_normalizer(pd_tok *t, json_t *j, pd_err *err) {
    if (!j || json_is_null(j)) return PD_OK;
    const char *type = jstr(j, "type");
    if (!type) return pd_err_set(err, PD_ERR_PROTO, TJ ": normalizer without \"type\"");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(j, "normalizers"), *v;
        size_t i;
        json_array_foreach(list, i, v) {
            pd_status st = load_normalizer(t, v, err);
            if (st != PD_OK) return st;
        }
        return PD_OK;
    }
    if (t->n_norms == PD_TOK_MAX_STEPS) return too_many(err, "normalizer");
    pd_tok_norm *n = &t->norms[t->n_norms];
    memset(n, 0, sizeof(*n));
    pd_status st = PD_OK;
    if (!strcmp(type, "Prepend")) {
        n->kind = PD_TOK_NORM_PREPEND;
        st = str_field(t, j, "prepend", "normalizer Prepend", &n->a_off, &n->a_len, err);
    } else if (!strcmp(type, "Replace")) {
        n->kind = PD_TOK_NORM_REPLACE;
        json_t *pat = json_object_get(j, "pattern");
        json_t *lit = json_object_get(pat, "String");
        if (json_is_string(lit)) {
            int64_t off = pool_add(t, json_string_value(lit), json_string_length(lit));
            if (off < 0) return nomem(err);
            n->a_off = (uint32_t)off;
            n->a_len = (uint32_t)json_string_length(lit);
        } else {
            n->re = pattern_compile(t, pat, "normalizer Replace", err);
            if (!n->re) return err ? err->status : PD_ERR_PROTO;
        }
        st = str_field(t, j, "content", "normalizer Replace", &n->b_off, &n->b_len, err);
    } else if (!strcmp(type, "NFC")) {
        n->kind = PD_TOK_NORM_NFC;
    } else if (!strcmp(type, "Strip")) {
        n->kind = PD_TOK_NORM_STRIP;
        n->left = jbool(j, "strip_left", true);
        n->right = jbool(j, "strip_right", true);
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": normalizer type '%s' is not supported", type);
    }
    if (st == PD_OK) t->n_norms++;
    else if (n->re) pcre2_code_free(n->re);
    return st;
}

static const char GPT2_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static pd_status prepend_scheme(json_t *j, const char *what, pd_tok_prepend *out, pd_err *err) {
    const char *ps = jstr(j, "prepend_scheme");
    if (!ps) {  // files older than tokenizers 0.14 spell it add_prefix_space
        *out = jbool(j, "add_prefix_space", true) ? PD_TOK_PREPEND_ALWAYS : PD_TOK_PREPEND_NEVER;
    } else if (!strcmp(ps, "always")) {
        *out = PD_TOK_PREPEND_ALWAYS;
    } else if (!strcmp(ps, "first")) {
        *out = PD_TOK_PREPEND_FIRST;
    } else if (!strcmp(ps, "never")) {
        *out = PD_TOK_PREPEND_NEVER;
    } else {
        return pd_err_set(err, PD_ERR_PROTO, TJ ": %s: unknown prepend_scheme '%s'", what, ps);
    }
    return PD_OK;
}

static pd_status load_split(pd_tok *t, json_t *j, pd_tok_pre *p, pd_err *err) {
    static const struct { const char *name; pd_tok_split_behavior b; } behaviors[] = {
        {"Removed", PD_TOK_SPLIT_REMOVED},          {"Isolated", PD_TOK_SPLIT_ISOLATED},
        {"MergedWithPrevious", PD_TOK_SPLIT_MERGED_PREV}, {"MergedWithNext", PD_TOK_SPLIT_MERGED_NEXT},
        {"Contiguous", PD_TOK_SPLIT_CONTIGUOUS},
    };
    const char *b = jstr(j, "behavior");
    int k = 0;
    for (; b && k < (int)PD_ARRAY_LEN(behaviors); k++) {
        if (!strcmp(b, behaviors[k].name)) break;
    }
    if (!b || k == (int)PD_ARRAY_LEN(behaviors)) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": pre_tokenizer Split behavior '%s' is not supported",
                          b ? b : "(none)");
    }
    p->kind = PD_TOK_PRE_SPLIT;
    p->behavior = behaviors[k].b;
    p->invert = jbool(j, "invert", false);
    p->re = pattern_compile(t, json_object_get(j, "pattern"), "pre_tokenizer Split", err);
    return p->re ? PD_OK : (err ? err->status : PD_ERR_PROTO);
}

static pd_status load_pre(pd_tok *t, json_t *j, pd_err *err) {
    if (!j || json_is_null(j)) return PD_OK;
    const char *type = jstr(j, "type");
    if (!type) return pd_err_set(err, PD_ERR_PROTO, TJ ": pre_tokenizer without \"type\"");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(j, "pretokenizers"), *v;
        size_t i;
        json_array_foreach(list, i, v) {
            pd_status st = load_pre(t, v, err);
            if (st != PD_OK) return st;
        }
        return PD_OK;
    }
    if (t->n_pres == PD_TOK_MAX_STEPS) return too_many(err, "pre_tokenizer");
    pd_tok_pre *p = &t->pres[t->n_pres];
    memset(p, 0, sizeof(*p));
    pd_status st = PD_OK;
    if (!strcmp(type, "Split")) {
        st = load_split(t, j, p, err);
    } else if (!strcmp(type, "ByteLevel")) {
        p->kind = PD_TOK_PRE_BYTELEVEL;
        p->add_prefix_space = jbool(j, "add_prefix_space", true);
        if (jbool(j, "use_regex", true)) {
            p->re = re_compile(t, GPT2_RE, sizeof(GPT2_RE) - 1, false, "ByteLevel", err);
            if (!p->re) return err ? err->status : PD_ERR_PROTO;
        }
    } else if (!strcmp(type, "Metaspace")) {
        p->kind = PD_TOK_PRE_METASPACE;
        st = str_field(t, j, "replacement", "pre_tokenizer Metaspace", &p->rep_off, &p->rep_len, err);
        if (st == PD_OK) st = prepend_scheme(j, "pre_tokenizer Metaspace", &p->prepend, err);
        p->split = jbool(j, "split", true);
    } else if (!strcmp(type, "Whitespace")) {  // keeps \w+|[^\w\s]+, drops the rest
        static const char re[] = "\\w+|[^\\w\\s]+";
        p->kind = PD_TOK_PRE_SPLIT;
        p->behavior = PD_TOK_SPLIT_REMOVED;
        p->invert = true;
        p->re = re_compile(t, re, sizeof(re) - 1, false, "Whitespace", err);
        if (!p->re) return err ? err->status : PD_ERR_PROTO;
    } else if (!strcmp(type, "WhitespaceSplit")) {
        static const char re[] = "\\s+";
        p->kind = PD_TOK_PRE_SPLIT;
        p->behavior = PD_TOK_SPLIT_REMOVED;
        p->re = re_compile(t, re, sizeof(re) - 1, false, "WhitespaceSplit", err);
        if (!p->re) return err ? err->status : PD_ERR_PROTO;
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": pre_tokenizer type '%s' is not supported", type);
    }
    if (st == PD_OK) t->n_pres++;
    else if (p->re) pcre2_code_free(p->re);
    return st;
}

static pd_status load_decoder(pd_tok *t, json_t *j, pd_err *err) {
    if (!j || json_is_null(j)) return PD_OK;
    const char *type = jstr(j, "type");
    if (!type) return pd_err_set(err, PD_ERR_PROTO, TJ ": decoder without \"type\"");
    t->has_decoder = true;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(j, "decoders"), *v;
        size_t i;
        json_array_foreach(list, i, v) {
            pd_status st = load_decoder(t, v, err);
            if (st != PD_OK) return st;
        }
        return PD_OK;
    }
    if (t->n_decs == PD_TOK_MAX_STEPS) return too_many(err, "decoder");
    pd_tok_dec *d = &t->decs[t->n_decs];
    memset(d, 0, sizeof(*d));
    pd_status st = PD_OK;
    bool after_fuse = t->dec_fuse_idx < t->n_decs;
    if (!strcmp(type, "ByteLevel")) {
        d->kind = PD_TOK_DEC_BYTELEVEL;
    } else if (!strcmp(type, "Replace")) {
        d->kind = PD_TOK_DEC_REPLACE;
        json_t *pat = json_object_get(j, "pattern");
        json_t *lit = json_object_get(pat, "String");
        if (!json_is_string(lit) || json_string_length(lit) == 0) {
            return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": decoder Replace supports only a non-empty String pattern");
        }
        int64_t off = pool_add(t, json_string_value(lit), json_string_length(lit));
        if (off < 0) return nomem(err);
        d->a_off = (uint32_t)off;
        d->a_len = (uint32_t)json_string_length(lit);
        st = str_field(t, j, "content", "decoder Replace", &d->b_off, &d->b_len, err);
    } else if (!strcmp(type, "ByteFallback")) {
        d->kind = PD_TOK_DEC_BYTEFALLBACK;
    } else if (!strcmp(type, "Fuse")) {
        d->kind = PD_TOK_DEC_FUSE;
    } else if (!strcmp(type, "Strip")) {
        d->kind = PD_TOK_DEC_STRIP;
        st = str_field(t, j, "content", "decoder Strip", &d->a_off, &d->a_len, err);
        json_t *a = json_object_get(j, "start"), *b = json_object_get(j, "stop");
        d->start = json_is_integer(a) ? (int)json_integer_value(a) : 0;
        d->stop = json_is_integer(b) ? (int)json_integer_value(b) : 0;
        if (st == PD_OK && (d->start < 0 || d->stop < 0 || pd_tok_utf8_len((const unsigned char *)t->pool + d->a_off, d->a_len) != (int)d->a_len)) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": decoder Strip needs one content char and start, stop >= 0");
        }
    } else if (!strcmp(type, "Metaspace")) {
        d->kind = PD_TOK_DEC_METASPACE;
        pd_tok_prepend ps = PD_TOK_PREPEND_ALWAYS;
        st = str_field(t, j, "replacement", "decoder Metaspace", &d->a_off, &d->a_len, err);
        if (st == PD_OK) st = prepend_scheme(j, "decoder Metaspace", &ps, err);
        d->strip_first = ps != PD_TOK_PREPEND_NEVER;
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": decoder type '%s' is not supported", type);
    }
    if (st != PD_OK) return st;
    // After a Fuse (or ByteLevel, which also joins everything into one string) the decoder sees
    // one growing string; only character-level steps can be streamed over it.
    if (after_fuse && (d->kind == PD_TOK_DEC_BYTELEVEL || d->kind == PD_TOK_DEC_BYTEFALLBACK)) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": decoder %s after Fuse/ByteLevel is not supported", type);
    }
    if (!after_fuse && (d->kind == PD_TOK_DEC_FUSE || d->kind == PD_TOK_DEC_BYTELEVEL)) t->dec_fuse_idx = t->n_decs;
    t->n_decs++;
    return PD_OK;
}

static pd_status add_ids(int32_t *dst, int *n, int32_t id, pd_err *err) {
    if (*n == 8) return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": post_processor adds more than 8 tokens");
    dst[(*n)++] = id;
    return PD_OK;
}

static pd_status load_template(pd_tok *t, json_t *j, pd_err *err) {
    json_t *single = json_object_get(j, "single"), *specials = json_object_get(j, "special_tokens"), *item;
    int32_t pre[8], suf[8];
    int n_pre = 0, n_suf = 0, n_seq = 0;
    size_t i;
    json_array_foreach(single, i, item) {
        json_t *sp = json_object_get(item, "SpecialToken");
        if (json_object_get(item, "Sequence")) {
            n_seq++;
            continue;
        }
        const char *name = jstr(sp, "id");
        json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids"), *idv;
        if (!name || !json_is_array(ids)) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": TemplateProcessing special token '%s' has no ids",
                              name ? name : "(none)");
        }
        size_t k;
        json_array_foreach(ids, k, idv) {
            int32_t id = (int32_t)json_integer_value(idv);
            if (id < 0 || id >= t->n_vocab) {
                return pd_err_set(err, PD_ERR_PROTO, TJ ": TemplateProcessing id %d out of range", id);
            }
            pd_status st = n_seq ? add_ids(suf, &n_suf, id, err) : add_ids(pre, &n_pre, id, err);
            if (st != PD_OK) return st;
        }
    }
    if (n_seq != 1) return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": TemplateProcessing single needs exactly one $A");
    // Nested processors wrap the previous result: prefix = new + old, suffix = old + new.
    int32_t old_pre[8];
    memcpy(old_pre, t->prefix_ids, sizeof(old_pre));
    int n_old_pre = t->n_prefix;
    t->n_prefix = 0;
    for (int k = 0; k < n_pre; k++) add_ids(t->prefix_ids, &t->n_prefix, pre[k], NULL);
    for (int k = 0; k < n_old_pre; k++) {
        pd_status st = add_ids(t->prefix_ids, &t->n_prefix, old_pre[k], err);
        if (st != PD_OK) return st;
    }
    for (int k = 0; k < n_suf; k++) {
        pd_status st = add_ids(t->suffix_ids, &t->n_suffix, suf[k], err);
        if (st != PD_OK) return st;
    }
    return PD_OK;
}

static pd_status load_post(pd_tok *t, json_t *j, pd_err *err) {
    if (!j || json_is_null(j)) return PD_OK;
    const char *type = jstr(j, "type");
    if (!type) return pd_err_set(err, PD_ERR_PROTO, TJ ": post_processor without \"type\"");
    t->has_post = true;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(j, "processors"), *v;
        size_t i;
        json_array_foreach(list, i, v) {
            pd_status st = load_post(t, v, err);
            if (st != PD_OK) return st;
        }
        return PD_OK;
    }
    if (!strcmp(type, "ByteLevel")) return PD_OK;  // offsets only
    if (!strcmp(type, "TemplateProcessing")) return load_template(t, j, err);
    if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
        json_t *cls = json_object_get(j, "cls"), *sep = json_object_get(j, "sep");
        int32_t c = (int32_t)json_integer_value(json_array_get(cls, 1));
        int32_t s = (int32_t)json_integer_value(json_array_get(sep, 1));
        if (c < 0 || c >= t->n_vocab || s < 0 || s >= t->n_vocab) {
            return pd_err_set(err, PD_ERR_PROTO, TJ ": %s needs cls and sep [token, id]", type);
        }
        pd_status st = add_ids(t->prefix_ids, &t->n_prefix, c, err);
        if (st == PD_OK) st = add_ids(t->suffix_ids, &t->n_suffix, s, err);
        return st;
    }
    return pd_err_set(err, PD_ERR_UNSUPPORTED, TJ ": post_processor type '%s' is not supported", type);
}

// ---- added-token tries -----------------------------------------------------------------------

static pd_status trie_add(pd_tok_trie *tr, const char *s, size_t n, int32_t term) {
    if (tr->n == 0) {
        if (PD_ARRAY_RESERVE(tr->nodes, tr->cap, 64) != PD_OK) return PD_ERR_NOMEM;
        tr->nodes[0] = (pd_tok_trie_node){.child = -1, .sibling = -1, .term = -1};
        tr->n = 1;
    }
    int32_t cur = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        int32_t k = tr->nodes[cur].child;
        while (k >= 0 && tr->nodes[k].byte != c) k = tr->nodes[k].sibling;
        if (k < 0) {
            if (tr->n == INT32_MAX || PD_ARRAY_RESERVE(tr->nodes, tr->cap, (size_t)tr->n + 1) != PD_OK)
                return PD_ERR_NOMEM;
            k = tr->n++;
            tr->nodes[k] = (pd_tok_trie_node){.child = -1, .sibling = tr->nodes[cur].child, .term = -1, .byte = c};
            tr->nodes[cur].child = k;
        }
        cur = k;
    }
    if (tr->nodes[cur].term < 0) tr->nodes[cur].term = term;
    if (n) tr->first_byte[(uint8_t)s[0]] = true;
    return PD_OK;
}

// HF builds its matchers from the special tokens first, then the other added tokens; the first
// token with a given pattern wins.
static pd_status build_tries(pd_tok *t, pd_err *err) {
    pd_buf nb = {0};
    pd_status st = PD_OK;
    for (int pass = 0; pass < 2 && st == PD_OK; pass++) {
        for (int k = 0; k < t->n_added && st == PD_OK; k++) {
            pd_tok_added *a = &t->added[k];
            if (a->special != (pass == 0)) continue;
            if (!a->normalized) {
                st = trie_add(&t->trie_raw, t->pool + a->off, a->len, k);
                continue;
            }
            nb.len = 0;
            st = pd_tok_normalize(t, t->pool + a->off, a->len, &nb);
            if (st != PD_OK) break;
            int64_t off = pool_add(t, nb.p ? nb.p : "", nb.len);
            if (off < 0) {
                st = PD_ERR_NOMEM;
                break;
            }
            a->norm_off = (uint32_t)off;
            a->norm_len = (uint32_t)nb.len;
            // HF reports (and decodes) a normalized added token by its normalized content.
            t->tokens[a->id].str_off = a->norm_off;
            t->tokens[a->id].str_len = a->norm_len;
            if (nb.len) st = trie_add(&t->trie_norm, t->pool + a->norm_off, a->norm_len, k);
        }
    }
    pd_buf_free(&nb);
    return st == PD_OK ? PD_OK : nomem(err);
}

// ---- token bytes -------------------------------------------------------------------------------

static void init_byte_tables(pd_tok *t) {
    int16_t *char_to_byte = t->char_to_byte;
    // GPT-2 bytes_to_unicode: printable bytes map to themselves, the others to 256, 257, ...
    int next = 256;
    for (int i = 0; i < 324; i++) char_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        uint32_t cp = printable ? (uint32_t)b : (uint32_t)next++;
        t->byte_char_len[b] = (uint8_t)pd_tok_utf8_encode(cp, t->byte_char[b]);
        char_to_byte[cp] = (int16_t)b;
    }
}

// Replaces every occurrence of pat with rep in b (in place, through a scratch buffer).
static pd_status replace_all(pd_buf *b, pd_buf *tmp, const char *pat, size_t np,
                             const char *rep, size_t nr) {
    tmp->len = 0;
    size_t i = 0;
    while (i < b->len) {
        if (i + np <= b->len && memcmp(b->p + i, pat, np) == 0) {
            if (pd_buf_append(tmp, rep, nr) != PD_OK) return PD_ERR_NOMEM;
            i += np;
        } else {
            if (pd_buf_append(tmp, b->p + i, 1) != PD_OK) return PD_ERR_NOMEM;
            i++;
        }
    }
    b->len = 0;
    return pd_buf_append(b, tmp->p ? tmp->p : "", tmp->len);
}

// What one token decodes to on its own, without the decoder's context rules (Strip, first-token
// Metaspace): the decoder steps applied to this token alone.
static pd_status token_bytes_one(pd_tok *t, const char *s, size_t n,
                                 pd_buf *b, pd_buf *tmp) {
    b->len = 0;
    if (pd_buf_append(b, s, n) != PD_OK) return PD_ERR_NOMEM;
    for (int k = 0; k < t->n_decs; k++) {
        const pd_tok_dec *d = &t->decs[k];
        uint8_t byte;
        if (d->kind == PD_TOK_DEC_REPLACE || d->kind == PD_TOK_DEC_METASPACE) {
            const char *rep = d->kind == PD_TOK_DEC_REPLACE ? t->pool + d->b_off : " ";
            size_t nr = d->kind == PD_TOK_DEC_REPLACE ? d->b_len : 1;
            if (replace_all(b, tmp, t->pool + d->a_off, d->a_len, rep, nr) != PD_OK) return PD_ERR_NOMEM;
        } else if (d->kind == PD_TOK_DEC_BYTEFALLBACK && pd_tok_byte_token(b->p, b->len, &byte)) {
            b->p[0] = (char)byte;
            b->len = 1;
        } else if (d->kind == PD_TOK_DEC_BYTELEVEL) {
            tmp->len = 0;
            const unsigned char *p = (const unsigned char *)b->p;
            size_t i = 0;
            bool ok = true;
            while (i < b->len && ok) {
                uint32_t cp;
                i += (size_t)pd_tok_utf8_decode(p + i, b->len - i, &cp);
                ok = cp < 324 && t->char_to_byte[cp] >= 0;
                uint8_t by = ok ? (uint8_t)t->char_to_byte[cp] : 0;
                if (ok && pd_buf_append(tmp, &by, 1) != PD_OK) return PD_ERR_NOMEM;
            }
            if (ok) {  // else keep the string's own bytes, as HF does
                b->len = 0;
                if (pd_buf_append(b, tmp->p ? tmp->p : "", tmp->len) != PD_OK) return PD_ERR_NOMEM;
            }
        }
    }
    return PD_OK;
}

static pd_status compute_token_bytes(pd_tok *t, pd_err *err) {
    init_byte_tables(t);
    pd_buf b = {0}, tmp = {0};
    pd_status st = PD_OK;
    for (int id = 0; id < t->n_vocab && st == PD_OK; id++) {
        pd_tok_token *tk = &t->tokens[id];
        if (!tk->flags) continue;
        st = token_bytes_one(t, t->pool + tk->str_off, tk->str_len, &b, &tmp);
        if (st != PD_OK) break;
        int64_t off = pool_add(t, b.p ? b.p : "", b.len);
        if (off < 0) {
            st = PD_ERR_NOMEM;
            break;
        }
        tk->bytes_off = (uint32_t)off;
        tk->bytes_len = (uint32_t)b.len;
    }
    pd_buf_free(&b);
    pd_buf_free(&tmp);
    return st == PD_OK ? PD_OK : nomem(err);
}

// ---- tokenizer_config.json ----------------------------------------------------------------------

// A special-token entry: "<s>" or {"content": "<s>", ...} (older AddedToken form).
static const char *config_token(json_t *c, const char *key) {
    json_t *v = json_object_get(c, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static pd_status add_template(pd_tok *t, const char *name, const char *text) {
    size_t need = (size_t)t->n_tmpl + 1;
    if (PD_ARRAY_RESERVE(t->tmpl_names, t->cap_tmpl_names, need) != PD_OK ||
        PD_ARRAY_RESERVE(t->tmpl_texts, t->cap_tmpl_texts, need) != PD_OK)
        return PD_ERR_NOMEM;
    char **names = t->tmpl_names, **texts = t->tmpl_texts;
    names[t->n_tmpl] = pd_strdup(name);
    texts[t->n_tmpl] = pd_strdup(text);
    t->n_tmpl++;
    if (!names[t->n_tmpl - 1] || !texts[t->n_tmpl - 1]) return PD_ERR_NOMEM;
    if (!strcmp(name, "default") && t->default_tmpl < 0) t->default_tmpl = t->n_tmpl - 1;
    return PD_OK;
}

static pd_status load_chat_templates(pd_tok *t, json_t *ct) {
    if (json_is_string(ct)) return add_template(t, "default", json_string_value(ct));
    size_t i;
    json_t *v;
    json_array_foreach(ct, i, v) {
        const char *name = jstr(v, "name"), *text = jstr(v, "template");
        if (name && text && add_template(t, name, text) != PD_OK) return PD_ERR_NOMEM;
    }
    return PD_OK;
}

static pd_status load_config(pd_tok *t, const char *dir, pd_err *err) {
    json_t *c = NULL;
    pd_status st = load_json(dir, "tokenizer_config.json", true, &c, err);
    if (st != PD_OK) return st;
    t->bos_id = t->eos_id = -1;
    if (c) {
        const char *bos = config_token(c, "bos_token"), *eos = config_token(c, "eos_token");
        if (bos) t->bos_id = pd_tok_token_to_id(t, bos, strlen(bos));
        if (eos) t->eos_id = pd_tok_token_to_id(t, eos, strlen(eos));
        // The strings are kept even when the vocabulary lacks them (a chat template may use them).
        if ((bos && !(t->bos_token = pd_strdup(bos))) || (eos && !(t->eos_token = pd_strdup(eos)))) st = nomem(err);
        if (!t->has_post) {  // no template: transformers' add_bos_token / add_eos_token decide
            if (jbool(c, "add_bos_token", false) && t->bos_id >= 0) t->prefix_ids[t->n_prefix++] = t->bos_id;
            if (jbool(c, "add_eos_token", false) && t->eos_id >= 0) t->suffix_ids[t->n_suffix++] = t->eos_id;
        }
        if (load_chat_templates(t, json_object_get(c, "chat_template")) != PD_OK) st = nomem(err);
        json_decref(c);
    }
    if (t->bos_id < 0 && t->n_prefix == 1) t->bos_id = t->prefix_ids[0];
    if (st == PD_OK && !t->bos_token && t->bos_id >= 0 && !(t->bos_token = pd_strdup(pd_tok_token_str(t, t->bos_id)))) {
        st = nomem(err);
    }
    return st;
}

// ---- load / free ---------------------------------------------------------------------------------

static pd_status load_pipeline(pd_tok *t, json_t *root, pd_err *err) {
    pd_status st = load_normalizer(t, json_object_get(root, "normalizer"), err);
    if (st == PD_OK) st = build_tries(t, err);
    if (st == PD_OK) st = load_pre(t, json_object_get(root, "pre_tokenizer"), err);
    t->dec_fuse_idx = PD_TOK_MAX_STEPS + 1;
    if (st == PD_OK) st = load_decoder(t, json_object_get(root, "decoder"), err);
    if (t->dec_fuse_idx > t->n_decs) t->dec_fuse_idx = t->n_decs;
    if (st == PD_OK) st = load_post(t, json_object_get(root, "post_processor"), err);
    return st;
}

pd_tok *pd_tok_load(const char *model_dir, pd_err *err) {
    pd_tok *t = pd_calloc(1, sizeof(*t));
    if (!t) {
        nomem(err);
        return NULL;
    }
    t->default_tmpl = -1;
    t->bos_id = t->eos_id = t->unk_id = -1;
    json_t *root = NULL;
    pd_status st = PD_OK;
    t->gctx = pcre2_general_context_create(gctx_malloc, gctx_free, NULL);
    if (!t->gctx) st = nomem(err);
    if (st == PD_OK) st = load_json(model_dir, TJ, false, &root, err);
    if (st == PD_OK && !json_is_object(root)) st = pd_err_set(err, PD_ERR_PROTO, TJ ": top level is not an object");
    if (st == PD_OK) st = load_model(t, root, err);
    if (st == PD_OK) st = load_pipeline(t, root, err);
    if (st == PD_OK) st = compute_token_bytes(t, err);
    if (st == PD_OK) st = load_config(t, model_dir, err);
    if (st == PD_OK) {
        static const char word[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]";
        t->re_word = re_compile(t, word, sizeof(word) - 1, false, "single_word", err);
        if (!t->re_word) st = err ? err->status : PD_ERR_NOMEM;
    }
    json_decref(root);
    if (st != PD_OK) {
        pd_tok_free(t);
        return NULL;
    }
    return t;
}

void pd_tok_free(pd_tok *t) {
    if (!t) return;
    for (int i = 0; i < t->n_norms; i++) pcre2_code_free(t->norms[i].re);
    for (int i = 0; i < t->n_pres; i++) pcre2_code_free(t->pres[i].re);
    pcre2_code_free(t->re_word);
    pcre2_general_context_free(t->gctx);
    pd_tok_smap_fini(&t->vocab);
    pd_tok_smap_fini(&t->added_map);
    pd_tok_pmap_fini(&t->merges);
    pd_free(t->trie_raw.nodes);
    pd_free(t->trie_norm.nodes);
    for (int i = 0; i < t->n_tmpl; i++) {
        pd_free(t->tmpl_names[i]);
        pd_free(t->tmpl_texts[i]);
    }
    pd_free(t->tmpl_names);
    pd_free(t->tmpl_texts);
    pd_free(t->bos_token);
    pd_free(t->eos_token);
    pd_free(t->added);
    pd_free(t->added_key_off);
    pd_free(t->added_key_len);
    pd_free(t->str_off);
    pd_free(t->str_len);
    pd_free(t->tokens);
    pd_free(t->pool);
    pd_free(t);
}

// ---- accessors -----------------------------------------------------------------------------------

int pd_tok_n_vocab(const pd_tok *t) { return t->n_vocab; }
int32_t pd_tok_bos_id(const pd_tok *t) { return t->bos_id; }
int32_t pd_tok_eos_id(const pd_tok *t) { return t->eos_id; }
const char *pd_tok_bos_token(const pd_tok *t) { return t->bos_token; }
const char *pd_tok_eos_token(const pd_tok *t) { return t->eos_token; }
bool pd_tok_adds_bos(const pd_tok *t) { return t->n_prefix > 0 && t->prefix_ids[0] == t->bos_id; }

int32_t pd_tok_token_to_id(const pd_tok *t, const char *s, size_t len) {
    int32_t id = pd_tok_smap_get(&t->added_map, t->pool, t->added_key_off, t->added_key_len, s, len);
    return id >= 0 ? id : vocab_id(t, s, len);
}

const char *pd_tok_token_str(const pd_tok *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab || !t->tokens[id].flags) return NULL;
    return t->pool + t->tokens[id].str_off;
}

const char *pd_tok_token_bytes(const pd_tok *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab || !t->tokens[id].flags) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = t->tokens[id].bytes_len;
    return t->pool + t->tokens[id].bytes_off;
}

bool pd_tok_is_special(const pd_tok *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->tokens[id].flags & PD_TOK_TF_SPECIAL);
}

const char *pd_tok_chat_template(const pd_tok *t) {
    return t->default_tmpl >= 0 ? t->tmpl_texts[t->default_tmpl] : NULL;
}

const char *pd_tok_chat_template_named(const pd_tok *t, const char *name) {
    for (int i = 0; i < t->n_tmpl; i++) {
        if (!strcmp(t->tmpl_names[i], name)) return t->tmpl_texts[i];
    }
    return NULL;
}
