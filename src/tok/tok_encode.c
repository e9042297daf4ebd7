// tok_encode.c — text → ids, following HF tokenizers' pipeline step by step:
//
//   text ──added tokens (raw)──▶ segments ──normalizer──▶ ──added tokens (normalized)──▶
//        ──pre-tokenizer steps──▶ words ──BPE (per-call cache)──▶ ids, wrapped in the template
//
// Added tokens are found leftmost-longest with a byte trie, then filtered exactly as HF's
// AddedVocabulary::find_matches does (special tokens skipped when !parse_special, single_word,
// lstrip/rstrip widening the match). Regex splits reproduce Onig's find_iter, including its
// rule for empty matches. The BPE merge loop is HF's Word::merge_all: a binary heap of
// (rank, position) candidates over a doubly linked list of symbols, stale entries discarded when
// popped — O(n log n) per word, so one huge word (SentencePiece-style input has no pre-tokenizer)
// stays fast.
//
// Regexes are HF's Oniguruma patterns compiled with PCRE2 (UTF, UCP). Known divergence: PCRE2's
// \s also matches U+180E MONGOLIAN VOWEL SEPARATOR, which Oniguruma (Unicode White_Space) does
// not; text containing U+180E may split differently from HF.
//
// Each call owns its scratch space (pd_tok_work) including its BPE word cache, so concurrent
// calls on one pd_tok share nothing mutable.
#include <string.h>

#include "tok/tok_impl.h"

#define CACHE_MAX_WORD 256  // bytes; longer words are not cached

typedef struct piece {
    uint32_t off, len;
    bool first;  // starts at offset 0 of the original text (Metaspace prepend_scheme "first")
} piece;

typedef struct piece_list {
    pd_buf text;
    piece *p;
    int n;
    size_t cap;
} piece_list;

typedef struct sym {
    int32_t id, prev, next;
    uint32_t len;  // bytes; 0 = merged away
} sym;

typedef struct cand {
    int32_t rank, pos, new_id;
} cand;

typedef struct range {
    size_t a, b;
    bool match;
} range;

typedef struct work {
    const pd_tok *t;
    pd_tok_ids *out;
    bool parse_special;
    pcre2_match_data *md;
    pd_buf norm, tmp, wt;
    piece_list pl[2];
    range *rg;
    int n_rg;
    size_t cap_rg;
    range *rg2;
    size_t cap_rg2;
    sym *syms;
    size_t cap_syms;
    cand *heap;
    int n_heap;
    size_t cap_heap;
    // BPE cache: word → ids. Map values index the entry arrays.
    pd_tok_smap cache;
    pd_buf ckeys;
    uint32_t *ck_off, *ck_len, *cv_off, *cv_n;
    int n_cache;
    size_t cap_cache[4];  // of ck_off, ck_len, cv_off, cv_n
    pd_tok_ids cids;
    bool first_seg;  // the raw segment being normalized starts the text
} work;

static pd_status push_id(work *w, int32_t id) { return pd_tok_ids_push(w->out, id); }

// ---- regex matching (Onig find_iter semantics) -------------------------------------------------

static size_t char_len_at(const char *s, size_t n, size_t i) {
    if (i >= n) return 1;
    int l = pd_tok_utf8_len((const unsigned char *)s + i, n - i);
    return l > 0 ? (size_t)l : 1;
}

// One search from pos. 1 = found (*ms, *me), 0 = none, <0 = error.
static int re_search(pcre2_code *re, pcre2_match_data *md, const char *s, size_t n, size_t pos,
                     size_t *ms, size_t *me) {
    // NOTE: PCRE2_NO_UTF_CHECK is not an optimisation to drop: without it every call re-checks
    // the subject from pos to the end, which makes a split over n bytes O(n^2). Input was
    // validated once by pd_tok_encode.
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PD_LOG_W("tokenizer: regex match failed (PCRE2 error %d)", rc);
        return -1;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

static pd_status add_range(work *w, size_t a, size_t b, bool match) {
    if (PD_ARRAY_RESERVE(w->rg, w->cap_rg, (size_t)w->n_rg + 1) != PD_OK) return PD_ERR_NOMEM;
    w->rg[w->n_rg++] = (range){a, b, match};
    return PD_OK;
}

// HF Pattern::find_matches: ranges covering s, matches flagged. re == NULL: literal lit.
static pd_status find_matches(work *w, pcre2_code *re, const char *lit, size_t nlit, const char *s,
                              size_t n, bool invert) {
    w->n_rg = 0;
    if (n == 0) return add_range(w, 0, 0, false);
    size_t prev = 0, pos = 0, ms = 0, me = 0;
    int64_t last_end = -1;
    while (pos <= n) {
        if (re) {
            int rc = re_search(re, w->md, s, n, pos, &ms, &me);
            if (rc < 0) return PD_ERR_INVALID;
            if (rc == 0) break;
            if (ms == me && (int64_t)me == last_end) {  // no empty match right after a match
                pos += char_len_at(s, n, pos);
                continue;
            }
        } else {
            const char *f = nlit && pos + nlit <= n ? memmem(s + pos, n - pos, lit, nlit) : NULL;
            if (!f) break;
            ms = (size_t)(f - s);
            me = ms + nlit;
        }
        if (prev != ms && add_range(w, prev, ms, invert) != PD_OK) return PD_ERR_NOMEM;
        if (add_range(w, ms, me, !invert) != PD_OK) return PD_ERR_NOMEM;
        prev = pos = me;
        last_end = (int64_t)me;
    }
    if (prev != n && add_range(w, prev, n, invert) != PD_OK) return PD_ERR_NOMEM;
    return PD_OK;
}

// HF NormalizedString::split: applies the delimiter behavior to w->rg, in place. Ranges marked
// match=true afterwards are to be removed.
static pd_status apply_behavior(work *w, pd_tok_split_behavior b) {
    if (PD_ARRAY_RESERVE(w->rg2, w->cap_rg2, (size_t)w->n_rg) != PD_OK) return PD_ERR_NOMEM;
    range *in = w->rg, *out = w->rg2;
    int n = 0;
    bool prev_match = false;
    switch (b) {
    case PD_TOK_SPLIT_REMOVED: return PD_OK;
    case PD_TOK_SPLIT_ISOLATED:
        for (int i = 0; i < w->n_rg; i++) in[i].match = false;
        return PD_OK;
    case PD_TOK_SPLIT_MERGED_PREV:
    case PD_TOK_SPLIT_CONTIGUOUS:
        for (int i = 0; i < w->n_rg; i++) {
            bool merge = b == PD_TOK_SPLIT_MERGED_PREV ? (in[i].match && !prev_match) : (in[i].match == prev_match);
            if (merge && n > 0) out[n - 1].b = in[i].b;
            else out[n++] = (range){in[i].a, in[i].b, false};
            prev_match = in[i].match;
        }
        break;
    case PD_TOK_SPLIT_MERGED_NEXT:
        for (int i = w->n_rg - 1; i >= 0; i--) {
            if (in[i].match && !prev_match && n > 0) out[n - 1].a = in[i].a;
            else out[n++] = (range){in[i].a, in[i].b, false};
            prev_match = in[i].match;
        }
        for (int i = 0; i < n / 2; i++) {
            range r = out[i];
            out[i] = out[n - 1 - i];
            out[n - 1 - i] = r;
        }
        break;
    }
    memcpy(w->rg, out, (size_t)n * sizeof(range));
    w->n_rg = n;
    return PD_OK;
}

// ---- normalizer -------------------------------------------------------------------------------

static pd_status norm_replace(const pd_tok *t, const pd_tok_norm *nm, const char *s, size_t n,
                              pcre2_match_data *md, pd_buf *out) {
    const char *pat = t->pool + nm->a_off, *rep = t->pool + nm->b_off;
    size_t i = 0, ms = 0, me = 0;
    while (i <= n) {
        if (nm->re) {
            int rc = re_search(nm->re, md, s, n, i, &ms, &me);
            if (rc < 0) return PD_ERR_INVALID;
            if (rc == 0) break;
        } else {
            const char *f = nm->a_len && i + nm->a_len <= n ? memmem(s + i, n - i, pat, nm->a_len) : NULL;
            if (!f) break;
            ms = (size_t)(f - s);
            me = ms + nm->a_len;
        }
        if (pd_buf_append(out, s + i, ms - i) != PD_OK || pd_buf_append(out, rep, nm->b_len) != PD_OK) {
            return PD_ERR_NOMEM;
        }
        if (me == ms) {  // empty match: copy one char and move on
            size_t l = char_len_at(s, n, me);
            if (me < n && pd_buf_append(out, s + me, l) != PD_OK) return PD_ERR_NOMEM;
            me += l;
        }
        i = me;
    }
    return i < n ? pd_buf_append(out, s + i, n - i) : PD_OK;
}

static pd_status norm_strip(const pd_tok_norm *nm, const char *s, size_t n, pd_buf *out) {
    const unsigned char *p = (const unsigned char *)s;
    size_t a = 0, b = n;
    uint32_t cp;
    while (nm->left && a < b) {
        int l = pd_tok_utf8_decode(p + a, b - a, &cp);
        if (!pd_tok_is_space(cp)) break;
        a += (size_t)l;
    }
    while (nm->right && b > a) {
        size_t k = b - 1;
        while (k > a && (p[k] & 0xc0) == 0x80) k--;
        pd_tok_utf8_decode(p + k, b - k, &cp);
        if (!pd_tok_is_space(cp)) break;
        b = k;
    }
    return pd_buf_append(out, s + a, b - a);
}

pd_status pd_tok_normalize(const pd_tok *t, const char *s, size_t n, pd_buf *out) {
    pd_buf bufs[2] = {{0}, {0}};
    pcre2_match_data *md = NULL;
    pd_status st = PD_OK;
    const char *cur = s;
    size_t ncur = n;
    for (int k = 0; k < t->n_norms && st == PD_OK; k++) {
        const pd_tok_norm *nm = &t->norms[k];
        pd_buf *dst = &bufs[k & 1];
        dst->len = 0;
        switch (nm->kind) {
        case PD_TOK_NORM_PREPEND:
            if (ncur) st = pd_buf_append(dst, t->pool + nm->a_off, nm->a_len);
            if (st == PD_OK) st = pd_buf_append(dst, cur, ncur);
            break;
        case PD_TOK_NORM_REPLACE:
            if (nm->re && !md && !(md = pcre2_match_data_create(1, t->gctx))) st = PD_ERR_NOMEM;
            if (st == PD_OK) st = norm_replace(t, nm, cur, ncur, md, dst);
            break;
        case PD_TOK_NORM_NFC: st = pd_tok_nfc(cur, ncur, dst); break;
        case PD_TOK_NORM_STRIP: st = norm_strip(nm, cur, ncur, dst); break;
        }
        if (st == PD_OK && pd_buf_reserve(dst, 0) != PD_OK) st = PD_ERR_NOMEM;
        cur = dst->p;
        ncur = dst->len;
    }
    if (st == PD_OK) st = pd_buf_append(out, cur, ncur);
    pcre2_match_data_free(md);
    pd_buf_free(&bufs[0]);
    pd_buf_free(&bufs[1]);
    return st;
}

// ---- pre-tokenizer ------------------------------------------------------------------------------

static pd_status pl_add(piece_list *pl, const char *s, size_t n, bool first) {
    if (n == 0) return PD_OK;  // HF drops empty splits
    if (PD_ARRAY_RESERVE(pl->p, pl->cap, (size_t)pl->n + 1) != PD_OK) return PD_ERR_NOMEM;
    uint32_t off = (uint32_t)pl->text.len;
    if (pd_buf_append(&pl->text, s, n) != PD_OK) return PD_ERR_NOMEM;
    pl->p[pl->n++] = (piece){off, (uint32_t)n, first};
    return PD_OK;
}

// Splits s by w->rg (after apply_behavior) into dst; ByteLevel maps each piece's bytes.
static pd_status emit_ranges(work *w, const char *s, bool first, bool bytelevel, piece_list *dst) {
    for (int i = 0; i < w->n_rg; i++) {
        range r = w->rg[i];
        if (r.match || r.b == r.a) continue;
        bool f = first && r.a == 0;
        if (!bytelevel) {
            if (pl_add(dst, s + r.a, r.b - r.a, f) != PD_OK) return PD_ERR_NOMEM;
            continue;
        }
        w->tmp.len = 0;
        for (size_t k = r.a; k < r.b; k++) {
            uint8_t c = (uint8_t)s[k];
            if (pd_buf_append(&w->tmp, w->t->byte_char[c], w->t->byte_char_len[c]) != PD_OK) return PD_ERR_NOMEM;
        }
        if (pl_add(dst, w->tmp.p, w->tmp.len, f) != PD_OK) return PD_ERR_NOMEM;
    }
    return PD_OK;
}

static pd_status pre_step(work *w, const pd_tok_pre *p, const char *s, size_t n, bool first, piece_list *dst) {
    const pd_tok *t = w->t;
    pd_status st;
    if (p->kind == PD_TOK_PRE_SPLIT) {
        st = find_matches(w, p->re, NULL, 0, s, n, p->invert);
        if (st == PD_OK) st = apply_behavior(w, p->behavior);
        return st == PD_OK ? emit_ranges(w, s, first, false, dst) : st;
    }
    // ByteLevel and Metaspace rewrite the piece into w->wt first, then split it.
    pd_buf *wt = &w->wt;
    wt->len = 0;
    st = PD_OK;
    if (p->kind == PD_TOK_PRE_BYTELEVEL) {
        if (p->add_prefix_space && (n == 0 || s[0] != ' ')) st = pd_buf_append(wt, " ", 1);
        if (st == PD_OK) st = pd_buf_append(wt, s, n);
        if (st == PD_OK && p->re) st = find_matches(w, p->re, NULL, 0, wt->p, wt->len, false);
        if (st == PD_OK && !p->re) {
            w->n_rg = 0;
            st = add_range(w, 0, wt->len, false);
        }
        if (st == PD_OK) st = apply_behavior(w, PD_TOK_SPLIT_ISOLATED);
        return st == PD_OK ? emit_ranges(w, wt->p, first, true, dst) : st;
    }
    // Metaspace: ' ' → replacement, maybe prepend it, maybe split before each replacement.
    const char *rep = t->pool + p->rep_off;
    size_t nrep = p->rep_len;
    bool starts = (n > 0 && s[0] == ' ') || (n >= nrep && memcmp(s, rep, nrep) == 0);
    bool prepend = !starts && (p->prepend == PD_TOK_PREPEND_ALWAYS || (p->prepend == PD_TOK_PREPEND_FIRST && first));
    if (prepend) st = pd_buf_append(wt, rep, nrep);
    for (size_t i = 0; i < n && st == PD_OK; i++) {
        st = s[i] == ' ' ? pd_buf_append(wt, rep, nrep) : pd_buf_append(wt, s + i, 1);
    }
    if (st == PD_OK && pd_buf_reserve(wt, 0) != PD_OK) st = PD_ERR_NOMEM;
    if (st == PD_OK && p->split) {
        st = find_matches(w, NULL, rep, nrep, wt->p, wt->len, false);
        if (st == PD_OK) st = apply_behavior(w, PD_TOK_SPLIT_MERGED_NEXT);
    } else if (st == PD_OK) {
        w->n_rg = 0;
        st = add_range(w, 0, wt->len, false);
    }
    return st == PD_OK ? emit_ranges(w, wt->p, first, false, dst) : st;
}

// ---- BPE model ----------------------------------------------------------------------------------

static int32_t vocab_get(const pd_tok *t, const char *s, size_t n) {
    return pd_tok_smap_get(&t->vocab, t->pool, t->str_off, t->str_len, s, n);
}

static pd_status add_sym(work *w, int *n, int32_t id, uint32_t len) {
    if (PD_ARRAY_RESERVE(w->syms, w->cap_syms, (size_t)*n + 1) != PD_OK) return PD_ERR_NOMEM;
    w->syms[*n] = (sym){id, *n - 1, *n + 1, len};
    (*n)++;
    return PD_OK;
}

// HF BPE::merge_word, first half: one symbol per char (or its <0xNN> bytes, or unk).
static pd_status word_symbols(work *w, const char *s, size_t n, int *n_syms) {
    const pd_tok *t = w->t;
    int32_t unk_id = -1;
    uint32_t unk_len = 0;
    *n_syms = 0;
    for (size_t i = 0; i < n;) {
        size_t l = char_len_at(s, n, i);
        int32_t id = vocab_get(t, s + i, l);
        if (id >= 0) {
            if (unk_id >= 0 && add_sym(w, n_syms, unk_id, unk_len) != PD_OK) return PD_ERR_NOMEM;
            unk_id = -1;
            if (add_sym(w, n_syms, id, (uint32_t)l) != PD_OK) return PD_ERR_NOMEM;
            i += l;
            continue;
        }
        bool all_bytes = t->byte_fallback;
        for (size_t k = 0; k < l && all_bytes; k++) all_bytes = t->byte_ids[(uint8_t)s[i + k]] >= 0;
        if (all_bytes) {  // NOTE: like HF, a pending unk is not flushed before the bytes
            for (size_t k = 0; k < l; k++) {
                if (add_sym(w, n_syms, t->byte_ids[(uint8_t)s[i + k]], 1) != PD_OK) return PD_ERR_NOMEM;
            }
        } else if (t->unk_id >= 0) {
            if (unk_id >= 0 && t->fuse_unk) {
                unk_len += (uint32_t)l;
            } else {
                if (unk_id >= 0 && add_sym(w, n_syms, unk_id, unk_len) != PD_OK) return PD_ERR_NOMEM;
                unk_id = t->unk_id;
                unk_len = (uint32_t)l;
            }
        }  // no unk token: the char is dropped, as HF does
        i += l;
    }
    if (unk_id >= 0 && add_sym(w, n_syms, unk_id, unk_len) != PD_OK) return PD_ERR_NOMEM;
    if (*n_syms) w->syms[*n_syms - 1].next = -1;
    return PD_OK;
}

static bool cand_less(cand a, cand b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static pd_status heap_push(work *w, cand c) {
    if (PD_ARRAY_RESERVE(w->heap, w->cap_heap, (size_t)w->n_heap + 1) != PD_OK) return PD_ERR_NOMEM;
    int i = w->n_heap++;
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!cand_less(c, w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = c;
    return PD_OK;
}

static cand heap_pop(work *w) {
    cand top = w->heap[0], last = w->heap[--w->n_heap];
    int i = 0, n = w->n_heap;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_less(w->heap[c + 1], w->heap[c])) c++;
        if (!cand_less(w->heap[c], last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n > 0) w->heap[i] = last;
    return top;
}

static pd_status push_pair(work *w, int32_t pos) {
    const sym *a = &w->syms[pos];
    if (a->next < 0) return PD_OK;
    int32_t rank, id;
    if (!pd_tok_pmap_get(&w->t->merges, a->id, w->syms[a->next].id, &rank, &id)) return PD_OK;
    return heap_push(w, (cand){rank, pos, id});
}

// HF Word::merge_all (without dropout).
static pd_status merge_all(work *w, int n) {
    w->n_heap = 0;
    for (int i = 0; i + 1 < n; i++) {
        if (push_pair(w, i) != PD_OK) return PD_ERR_NOMEM;
    }
    while (w->n_heap > 0) {
        cand top = heap_pop(w);
        sym *cur = &w->syms[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        sym *right = &w->syms[cur->next];
        int32_t rank, id;
        // Stale entry: the pair at this position no longer merges into top.new_id.
        if (!pd_tok_pmap_get(&w->t->merges, cur->id, right->id, &rank, &id) || id != top.new_id) continue;
        cur->id = top.new_id;
        cur->len += right->len;
        cur->next = right->next;
        right->len = 0;
        if (cur->next >= 0) w->syms[cur->next].prev = top.pos;
        if (cur->prev >= 0 && push_pair(w, cur->prev) != PD_OK) return PD_ERR_NOMEM;
        if (push_pair(w, top.pos) != PD_OK) return PD_ERR_NOMEM;
    }
    return PD_OK;
}

static pd_status cache_grow(work *w) {
    size_t need = (size_t)w->n_cache + 1;
    if (PD_ARRAY_RESERVE(w->ck_off, w->cap_cache[0], need) != PD_OK ||
        PD_ARRAY_RESERVE(w->ck_len, w->cap_cache[1], need) != PD_OK ||
        PD_ARRAY_RESERVE(w->cv_off, w->cap_cache[2], need) != PD_OK ||
        PD_ARRAY_RESERVE(w->cv_n, w->cap_cache[3], need) != PD_OK)
        return PD_ERR_NOMEM;  // a failure midway leaves some arrays merely larger
    return PD_OK;
}

static pd_status cache_put(work *w, const char *s, size_t n, const int32_t *ids, int n_ids) {
    if (cache_grow(w) != PD_OK) return PD_ERR_NOMEM;
    int e = w->n_cache;
    w->ck_off[e] = (uint32_t)w->ckeys.len;
    w->ck_len[e] = (uint32_t)n;
    w->cv_off[e] = (uint32_t)w->cids.n;
    w->cv_n[e] = (uint32_t)n_ids;
    if (pd_buf_append(&w->ckeys, s, n) != PD_OK) return PD_ERR_NOMEM;
    for (int i = 0; i < n_ids; i++) {
        if (pd_tok_ids_push(&w->cids, ids[i]) != PD_OK) return PD_ERR_NOMEM;
    }
    w->n_cache++;
    return pd_tok_smap_put(&w->cache, w->ckeys.p, w->ck_off, w->ck_len, e);
}

static pd_status bpe_word(work *w, const char *s, size_t n) {
    const pd_tok *t = w->t;
    if (t->ignore_merges) {
        int32_t id = vocab_get(t, s, n);
        if (id >= 0) return push_id(w, id);
    }
    bool cacheable = n <= CACHE_MAX_WORD;
    if (cacheable && w->n_cache) {
        int32_t e = pd_tok_smap_get(&w->cache, w->ckeys.p, w->ck_off, w->ck_len, s, n);
        if (e >= 0) {
            for (uint32_t i = 0; i < w->cv_n[e]; i++) {
                if (push_id(w, w->cids.ids[w->cv_off[e] + i]) != PD_OK) return PD_ERR_NOMEM;
            }
            return PD_OK;
        }
    }
    int n_syms;
    if (word_symbols(w, s, n, &n_syms) != PD_OK || merge_all(w, n_syms) != PD_OK) return PD_ERR_NOMEM;
    int first = w->out->n;
    for (int i = 0; i < n_syms; i = w->syms[i].next) {
        if (push_id(w, w->syms[i].id) != PD_OK) return PD_ERR_NOMEM;
        if (w->syms[i].next < 0) break;
    }
    if (cacheable) return cache_put(w, s, n, w->out->ids + first, w->out->n - first);
    return PD_OK;
}

// ---- added tokens ----------------------------------------------------------------------------------

static bool is_word_char(const work *w, const char *s, size_t n) {
    return pcre2_match(w->t->re_word, (PCRE2_SPTR)s, n, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, w->md, NULL) >= 0;
}

// Rust regex \w$ on s[0..n).
static bool ends_with_word(const work *w, const char *s, size_t n) {
    if (n == 0) return false;
    size_t k = n - 1;
    while (k > 0 && ((uint8_t)s[k] & 0xc0) == 0x80) k--;
    return is_word_char(w, s + k, n - k);
}

static bool starts_with_word(const work *w, const char *s, size_t n) {
    return n > 0 && is_word_char(w, s, char_len_at(s, n, 0));
}

typedef pd_status (*segment_fn)(work *w, const char *s, size_t n, size_t at);

// The longest added token at s[i..n); its index or -1, end in *end.
static int32_t trie_longest(const pd_tok_trie *tr, const char *s, size_t n, size_t i, size_t *end) {
    int32_t node = 0, best = -1;
    for (size_t j = i; j < n; j++) {
        int32_t k = tr->nodes[node].child;
        while (k >= 0 && tr->nodes[k].byte != (uint8_t)s[j]) k = tr->nodes[k].sibling;
        if (k < 0) break;
        node = k;
        if (tr->nodes[k].term >= 0) {
            best = tr->nodes[k].term;
            *end = j + 1;
        }
    }
    return best;
}

// HF AddedVocabulary::find_matches + split: text between added tokens goes to fn, added tokens
// become ids.
static pd_status split_added(work *w, const pd_tok_trie *tr, const char *s, size_t n, segment_fn fn) {
    const pd_tok *t = w->t;
    size_t start_offset = 0, i = 0;
    while (tr->n > 0 && i < n) {
        size_t end = 0;
        int32_t k = tr->first_byte[(uint8_t)s[i]] ? trie_longest(tr, s, n, i, &end) : -1;
        if (k < 0) {
            i++;
            continue;
        }
        const pd_tok_added *a = &t->added[k];
        size_t start = i, stop = end;
        i = end;  // the automaton resumes after the match, whether or not it is kept
        if (a->special && !w->parse_special) continue;
        if (a->single_word && ((start > 0 && ends_with_word(w, s, start)) ||
                               (stop < n && starts_with_word(w, s + stop, n - stop)))) {
            continue;
        }
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t q = ns - 1;
                while (q > 0 && ((uint8_t)s[q] & 0xc0) == 0x80) q--;
                uint32_t cp;
                pd_tok_utf8_decode((const unsigned char *)s + q, ns - q, &cp);
                if (!pd_tok_is_space(cp)) break;
                ns = q;
            }
            start = PD_MAX(ns, start_offset);
        }
        if (a->rstrip) {
            uint32_t cp;
            while (stop < n) {
                int l = pd_tok_utf8_decode((const unsigned char *)s + stop, n - stop, &cp);
                if (!pd_tok_is_space(cp)) break;
                stop += (size_t)l;
            }
        }
        if (start_offset < start) {
            pd_status st = fn(w, s + start_offset, start - start_offset, start_offset);
            if (st != PD_OK) return st;
        }
        if (push_id(w, a->id) != PD_OK) return PD_ERR_NOMEM;
        start_offset = stop;
    }
    if (start_offset < n) return fn(w, s + start_offset, n - start_offset, start_offset);
    return PD_OK;
}

// ---- the pipeline ------------------------------------------------------------------------------------

// One normalized piece between added tokens: pre-tokenize, then BPE each word.
static pd_status encode_words(work *w, const char *s, size_t n, bool first) {
    const pd_tok *t = w->t;
    if (t->n_pres == 0) return n ? bpe_word(w, s, n) : PD_OK;
    piece_list *src = &w->pl[0], *dst = &w->pl[1];
    src->n = 0;
    src->text.len = 0;
    if (pl_add(src, s, n, first) != PD_OK) return PD_ERR_NOMEM;
    for (int k = 0; k < t->n_pres; k++) {
        dst->n = 0;
        dst->text.len = 0;
        for (int i = 0; i < src->n; i++) {
            piece pc = src->p[i];
            pd_status st = pre_step(w, &t->pres[k], src->text.p + pc.off, pc.len, pc.first, dst);
            if (st != PD_OK) return st;
        }
        piece_list *x = src;
        src = dst;
        dst = x;
    }
    for (int i = 0; i < src->n; i++) {
        pd_status st = bpe_word(w, src->text.p + src->p[i].off, src->p[i].len);
        if (st != PD_OK) return st;
    }
    return PD_OK;
}

static pd_status norm_piece(work *w, const char *s, size_t n, size_t at) {
    return encode_words(w, s, n, w->first_seg && at == 0);
}

// A raw segment between (non-normalized) added tokens: normalize, split normalized added
// tokens, encode the rest.
static pd_status raw_segment(work *w, const char *s, size_t n, size_t at) {
    const pd_tok *t = w->t;
    if (t->n_norms == 0 && t->trie_norm.n == 0) return encode_words(w, s, n, at == 0);
    w->norm.len = 0;
    pd_status st = pd_tok_normalize(t, s, n, &w->norm);
    if (st != PD_OK || w->norm.len == 0) return st;
    if (t->trie_norm.n == 0) return encode_words(w, w->norm.p, w->norm.len, at == 0);
    // Pieces of the normalized text: only one starting at its offset 0 can be "first".
    w->first_seg = at == 0;
    return split_added(w, &t->trie_norm, w->norm.p, w->norm.len, norm_piece);
}

pd_status pd_tok_encode(const pd_tok *t, const char *text, size_t len, bool add_special,
                        bool parse_special, pd_tok_ids *out) {
    if ((!text && len) || len > PD_TOK_MAX_TEXT_BYTES) return PD_ERR_INVALID;
    if (!pd_tok_utf8_valid(text, len)) return PD_ERR_INVALID;
    work w = {.t = t, .out = out, .parse_special = parse_special};
    int n0 = out->n;
    pd_status st = PD_OK;
    w.md = pcre2_match_data_create(1, t->gctx);
    if (!w.md) st = PD_ERR_NOMEM;
    for (int i = 0; add_special && st == PD_OK && i < t->n_prefix; i++) st = push_id(&w, t->prefix_ids[i]);
    if (st == PD_OK) st = split_added(&w, &t->trie_raw, text ? text : "", len, raw_segment);
    for (int i = 0; add_special && st == PD_OK && i < t->n_suffix; i++) st = push_id(&w, t->suffix_ids[i]);
    if (st != PD_OK) out->n = n0;
    pcre2_match_data_free(w.md);
    pd_buf_free(&w.norm);
    pd_buf_free(&w.tmp);
    pd_buf_free(&w.wt);
    for (int i = 0; i < 2; i++) {
        pd_buf_free(&w.pl[i].text);
        pd_free(w.pl[i].p);
    }
    pd_free(w.rg);
    pd_free(w.rg2);
    pd_free(w.syms);
    pd_free(w.heap);
    pd_tok_smap_fini(&w.cache);
    pd_buf_free(&w.ckeys);
    pd_free(w.ck_off);
    pd_free(w.ck_len);
    pd_free(w.cv_off);
    pd_free(w.cv_n);
    pd_tok_ids_free(&w.cids);
    return st;
}
