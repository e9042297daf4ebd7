// tok_decode.c — ids → text. One implementation serves both pd_tok_decode and the streaming
// detokenizer, so their outputs agree by construction: decode() is "feed every id, then finish".
//
// HF decoders work on the whole list of token strings (decode_chain). Here each decoder step is
// a small transducer that takes tokens one at a time and passes what it can already decide to
// the next step:
//
//   ids ─▶ token strings ─▶ [token phase: Replace, Strip, Metaspace, ByteFallback]
//                            ─▶ Fuse / ByteLevel ─▶ [fragment phase: Replace, Strip, Metaspace]
//                            ─▶ output
//
// In the token phase steps see whole tokens (Metaspace counts them, to treat token 0 apart;
// ByteFallback holds a run of <0xNN> tokens until the run ends, because HF decodes the run as a
// whole and turns an invalid run into one U+FFFD per byte). Fuse and ByteLevel join everything
// into ONE token, so steps after them see fragments of a single growing string: Replace holds a
// partial pattern match, Strip counts leading characters and holds up to `stop` trailing ones.
// ByteLevel turns characters back into bytes and decodes them like Rust's from_utf8_lossy,
// holding an incomplete sequence until the next byte settles it. Every fragment is whole UTF-8
// characters, so the output never splits a character.
//
// finish() flushes the steps in order (a trailing incomplete sequence becomes U+FFFD, as HF
// does) and resets the stream.
#include <string.h>

#include "tok/tok_impl.h"

static const char FFFD[] = "\xEF\xBF\xBD";

typedef struct step_state {
    long n_in;          // token phase: tokens received (Metaspace: token 0 is special)
    pd_buf hold;    // held-back bytes (ByteFallback run, partial match, trailing chars)
    pd_buf scratch; // per-step output space (steps call the next one while it is in use)
    int n_stripped;     // fragment-phase Strip: leading content chars removed so far
    bool past_start;    // fragment-phase Strip: saw a char that is not stripped
} step_state;

struct pd_tok_stream {
    const pd_tok *t;
    bool skip_special;
    bool joined_one;  // no decoder: HF joins tokens with " "
    pd_buf out;
    step_state st[PD_TOK_MAX_STEPS];
};

static pd_status frag_push(pd_tok_stream *s, int k, const char *p, size_t n);

static bool starts_with(const char *p, size_t n, const char *q, size_t nq) {
    return n >= nq && memcmp(p, q, nq) == 0;
}

// ---- token phase -------------------------------------------------------------------------------

static pd_status tok_push(pd_tok_stream *s, int k, const char *p, size_t n);

static pd_status bytefallback_flush(pd_tok_stream *s, int k) {
    pd_buf *run = &s->st[k].hold;
    if (run->len == 0) return PD_OK;
    pd_status st = PD_OK;
    if (pd_tok_utf8_valid(run->p, run->len)) {
        // run is re-used by the next token only after this returns; copy to scratch first.
        pd_buf *sc = &s->st[k].scratch;
        sc->len = 0;
        st = pd_buf_append(sc, run->p, run->len);
        run->len = 0;
        if (st == PD_OK) st = tok_push(s, k + 1, sc->p, sc->len);
    } else {
        size_t n = run->len;
        run->len = 0;
        for (size_t i = 0; i < n && st == PD_OK; i++) st = tok_push(s, k + 1, FFFD, 3);
    }
    return st;
}

static pd_status bytelevel_push(pd_tok_stream *s, int k, const char *p, size_t n) {
    const pd_tok *t = s->t;
    step_state *ss = &s->st[k];
    // Map chars back to bytes; a token with any other char keeps its own bytes (HF).
    size_t start = ss->hold.len;
    const unsigned char *q = (const unsigned char *)p;
    bool ok = true;
    for (size_t i = 0; i < n && ok;) {
        uint32_t cp;
        i += (size_t)pd_tok_utf8_decode(q + i, n - i, &cp);
        ok = cp < 324 && t->char_to_byte[cp] >= 0;
        uint8_t b = ok ? (uint8_t)t->char_to_byte[cp] : 0;
        if (ok && pd_buf_append(&ss->hold, &b, 1) != PD_OK) return PD_ERR_NOMEM;
    }
    if (!ok) {
        ss->hold.len = start;
        if (pd_buf_append(&ss->hold, p, n) != PD_OK) return PD_ERR_NOMEM;
    }
    // Lossy UTF-8 over held + new bytes: emit what is decided, keep an incomplete tail.
    pd_buf *sc = &ss->scratch;
    sc->len = 0;
    const unsigned char *b = (const unsigned char *)ss->hold.p;
    size_t i = 0, len = ss->hold.len;
    while (i < len) {
        int l = pd_tok_utf8_len(b + i, len - i);
        if (l > 0) {
            if (pd_buf_append(sc, b + i, (size_t)l) != PD_OK) return PD_ERR_NOMEM;
            i += (size_t)l;
            continue;
        }
        int bad = pd_tok_utf8_invalid_len(b + i, len - i, true);
        if (bad == 0) break;  // truncated: wait for more bytes
        if (pd_buf_append(sc, FFFD, 3) != PD_OK) return PD_ERR_NOMEM;
        i += (size_t)bad;
    }
    memmove(ss->hold.p, ss->hold.p + i, len - i);
    ss->hold.len = len - i;
    return sc->len ? frag_push(s, k + 1, sc->p, sc->len) : PD_OK;
}

// Metaspace decoder on one token (or fragment): replacement → ' ', or dropped in token 0.
static pd_status metaspace(pd_tok_stream *s, int k, const char *p, size_t n, bool drop, bool frag) {
    const pd_tok_dec *d = &s->t->decs[k];
    const char *rep = s->t->pool + d->a_off;
    pd_buf *sc = &s->st[k].scratch;
    sc->len = 0;
    for (size_t i = 0; i < n;) {
        if (starts_with(p + i, n - i, rep, d->a_len)) {
            if (!drop && pd_buf_append(sc, " ", 1) != PD_OK) return PD_ERR_NOMEM;
            i += d->a_len;
        } else {
            if (pd_buf_append(sc, p + i, 1) != PD_OK) return PD_ERR_NOMEM;
            i++;
        }
    }
    if (frag) return sc->len ? frag_push(s, k + 1, sc->p, sc->len) : PD_OK;
    return tok_push(s, k + 1, sc->p ? sc->p : "", sc->len);
}

// Strip on a whole token: up to `start` leading and `stop` trailing content chars.
static pd_status strip_token(pd_tok_stream *s, int k, const char *p, size_t n) {
    const pd_tok_dec *d = &s->t->decs[k];
    const char *c = s->t->pool + d->a_off;
    size_t cl = d->a_len, a = 0, b = n;
    for (int i = 0; i < d->start && starts_with(p + a, n - a, c, cl); i++) a += cl;
    for (int i = 0; i < d->stop && b >= a + cl && memcmp(p + b - cl, c, cl) == 0; i++) b -= cl;
    return tok_push(s, k + 1, p + a, b - a);
}

static pd_status tok_push(pd_tok_stream *s, int k, const char *p, size_t n) {
    const pd_tok *t = s->t;
    if (k == t->n_decs) return pd_buf_append(&s->out, p, n);
    const pd_tok_dec *d = &t->decs[k];
    step_state *ss = &s->st[k];
    switch (d->kind) {
    case PD_TOK_DEC_REPLACE: {
        pd_buf *sc = &ss->scratch;
        sc->len = 0;
        const char *pat = t->pool + d->a_off, *rep = t->pool + d->b_off;
        for (size_t i = 0; i < n;) {
            bool m = starts_with(p + i, n - i, pat, d->a_len);
            if (pd_buf_append(sc, m ? rep : p + i, m ? d->b_len : 1) != PD_OK) return PD_ERR_NOMEM;
            i += m ? d->a_len : 1;
        }
        return tok_push(s, k + 1, sc->p ? sc->p : "", sc->len);
    }
    case PD_TOK_DEC_STRIP: return strip_token(s, k, p, n);
    case PD_TOK_DEC_METASPACE: {
        bool drop = ss->n_in++ == 0 && d->strip_first;
        return metaspace(s, k, p, n, drop, false);
    }
    case PD_TOK_DEC_BYTEFALLBACK: {
        uint8_t byte;
        if (pd_tok_byte_token(p, n, &byte)) return pd_buf_append(&ss->hold, &byte, 1);
        pd_status st = bytefallback_flush(s, k);
        return st == PD_OK ? tok_push(s, k + 1, p, n) : st;
    }
    case PD_TOK_DEC_FUSE: return n ? frag_push(s, k + 1, p, n) : PD_OK;
    case PD_TOK_DEC_BYTELEVEL: return bytelevel_push(s, k, p, n);
    }
    return PD_OK;
}

// ---- fragment phase (after Fuse / ByteLevel: one growing token) ------------------------------

static pd_status replace_frag(pd_tok_stream *s, int k, const char *p, size_t n, bool final) {
    const pd_tok *t = s->t;
    const pd_tok_dec *d = &t->decs[k];
    step_state *ss = &s->st[k];
    const char *pat = t->pool + d->a_off, *rep = t->pool + d->b_off;
    if (pd_buf_append(&ss->hold, p, n) != PD_OK) return PD_ERR_NOMEM;
    pd_buf *sc = &ss->scratch;
    sc->len = 0;
    const char *b = ss->hold.p;
    size_t len = ss->hold.len, i = 0;
    while (i < len) {
        if (starts_with(b + i, len - i, pat, d->a_len)) {
            if (pd_buf_append(sc, rep, d->b_len) != PD_OK) return PD_ERR_NOMEM;
            i += d->a_len;
            continue;
        }
        if (!final && len - i < d->a_len && memcmp(b + i, pat, len - i) == 0) break;  // maybe a match
        if (pd_buf_append(sc, b + i, 1) != PD_OK) return PD_ERR_NOMEM;
        i++;
    }
    memmove(ss->hold.p, b + i, len - i);
    ss->hold.len = len - i;
    return sc->len ? frag_push(s, k + 1, sc->p, sc->len) : PD_OK;
}

static pd_status strip_frag(pd_tok_stream *s, int k, const char *p, size_t n) {
    const pd_tok_dec *d = &s->t->decs[k];
    step_state *ss = &s->st[k];
    const char *c = s->t->pool + d->a_off;
    size_t cl = d->a_len, a = 0;
    while (!ss->past_start && a < n) {
        if (ss->n_stripped < d->start && starts_with(p + a, n - a, c, cl)) {
            ss->n_stripped++;
            a += cl;
        } else {
            ss->past_start = true;
        }
    }
    if (a == n) return PD_OK;
    if (d->stop == 0) return frag_push(s, k + 1, p + a, n - a);
    // Hold the trailing run of content chars, at most `stop` of them (the rest is safe).
    if (pd_buf_append(&ss->hold, p + a, n - a) != PD_OK) return PD_ERR_NOMEM;
    size_t len = ss->hold.len, keep = 0;
    while (keep / cl < (size_t)d->stop && len >= keep + cl && memcmp(ss->hold.p + len - keep - cl, c, cl) == 0) keep += cl;
    pd_buf *sc = &ss->scratch;
    sc->len = 0;
    if (pd_buf_append(sc, ss->hold.p, len - keep) != PD_OK) return PD_ERR_NOMEM;
    memmove(ss->hold.p, ss->hold.p + len - keep, keep);
    ss->hold.len = keep;
    return sc->len ? frag_push(s, k + 1, sc->p, sc->len) : PD_OK;
}

static pd_status frag_push(pd_tok_stream *s, int k, const char *p, size_t n) {
    const pd_tok *t = s->t;
    if (k == t->n_decs) return pd_buf_append(&s->out, p, n);
    const pd_tok_dec *d = &t->decs[k];
    switch (d->kind) {
    case PD_TOK_DEC_REPLACE: return replace_frag(s, k, p, n, false);
    case PD_TOK_DEC_STRIP: return strip_frag(s, k, p, n);
    case PD_TOK_DEC_METASPACE: return metaspace(s, k, p, n, d->strip_first, true);  // one token: i == 0
    case PD_TOK_DEC_FUSE: return frag_push(s, k + 1, p, n);
    case PD_TOK_DEC_BYTELEVEL:
    case PD_TOK_DEC_BYTEFALLBACK: break;  // rejected at load
    }
    return PD_OK;
}

// ---- stream ------------------------------------------------------------------------------------

static pd_status push_id(pd_tok_stream *s, int32_t id) {
    const pd_tok *t = s->t;
    if (id < 0 || id >= t->n_vocab || !t->tokens[id].flags) return PD_OK;  // HF skips unknown ids
    const pd_tok_token *tk = &t->tokens[id];
    if (s->skip_special && (tk->flags & PD_TOK_TF_SPECIAL)) return PD_OK;
    const char *p = t->pool + tk->str_off;
    if (!t->has_decoder) {
        if (s->joined_one && pd_buf_append(&s->out, " ", 1) != PD_OK) return PD_ERR_NOMEM;
        s->joined_one = true;
        return pd_buf_append(&s->out, p, tk->str_len);
    }
    return tok_push(s, 0, p, tk->str_len);
}

static pd_status flush_all(pd_tok_stream *s) {
    const pd_tok *t = s->t;
    pd_status st = PD_OK;
    for (int k = 0; k < t->n_decs && st == PD_OK; k++) {
        step_state *ss = &s->st[k];
        bool frag = k > t->dec_fuse_idx;
        switch (t->decs[k].kind) {
        case PD_TOK_DEC_BYTEFALLBACK: st = bytefallback_flush(s, k); break;
        case PD_TOK_DEC_BYTELEVEL: {  // an unfinished sequence: one U+FFFD per maximal subpart
            pd_buf *sc = &ss->scratch;
            sc->len = 0;
            for (size_t i = 0; i < ss->hold.len && st == PD_OK;) {
                i += (size_t)pd_tok_utf8_invalid_len((const unsigned char *)ss->hold.p + i, ss->hold.len - i, false);
                st = pd_buf_append(sc, FFFD, 3);
            }
            ss->hold.len = 0;
            if (st == PD_OK && sc->len) st = frag_push(s, k + 1, sc->p, sc->len);
            break;
        }
        case PD_TOK_DEC_REPLACE:
            if (frag) st = replace_frag(s, k, "", 0, true);
            break;
        default: break;  // Strip: held trailing chars are stripped; nothing else holds text
        }
    }
    for (int k = 0; k < t->n_decs; k++) {
        s->st[k].hold.len = 0;
        s->st[k].n_in = 0;
        s->st[k].n_stripped = 0;
        s->st[k].past_start = false;
    }
    s->joined_one = false;
    return st;
}

static void stream_fini(pd_tok_stream *s) {
    for (int k = 0; k < PD_TOK_MAX_STEPS; k++) {
        pd_buf_free(&s->st[k].hold);
        pd_buf_free(&s->st[k].scratch);
    }
    pd_buf_free(&s->out);
}

pd_tok_stream *pd_tok_stream_new(const pd_tok *t, bool skip_special) {
    pd_tok_stream *s = pd_calloc(1, sizeof(*s));
    if (!s) return NULL;
    s->t = t;
    s->skip_special = skip_special;
    return s;
}

void pd_tok_stream_free(pd_tok_stream *s) {
    if (!s) return;
    stream_fini(s);
    pd_free(s);
}

static pd_status stream_result(pd_tok_stream *s, pd_status st, const char **text, size_t *len) {
    if (st != PD_OK || pd_buf_reserve(&s->out, 0) != PD_OK) {
        s->out.len = 0;
        st = st != PD_OK ? st : PD_ERR_NOMEM;
    }
    if (s->out.p) s->out.p[s->out.len] = 0;
    *text = s->out.p ? s->out.p : "";
    *len = s->out.len;
    return st;
}

pd_status pd_tok_stream_feed(pd_tok_stream *s, int32_t id, const char **text, size_t *len) {
    s->out.len = 0;
    return stream_result(s, push_id(s, id), text, len);
}

pd_status pd_tok_stream_finish(pd_tok_stream *s, const char **text, size_t *len) {
    s->out.len = 0;
    return stream_result(s, flush_all(s), text, len);
}

pd_status pd_tok_decode(const pd_tok *t, const int32_t *ids, int n, bool skip_special, char **out,
                        size_t *out_len) {
    pd_tok_stream s = {.t = t, .skip_special = skip_special};
    pd_status st = PD_OK;
    for (int i = 0; i < n && st == PD_OK; i++) st = push_id(&s, ids[i]);
    if (st == PD_OK) st = flush_all(&s);
    if (st == PD_OK) st = pd_buf_reserve(&s.out, 0);
    *out = NULL;
    *out_len = 0;
    if (st == PD_OK) {
        s.out.p[s.out.len] = 0;
        *out = s.out.p;
        *out_len = s.out.len;
        s.out.p = NULL;
    }
    stream_fini(&s);
    return st;
}
