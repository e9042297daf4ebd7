// tok_stop.c — stop-string matching over streamed text (OpenAI "stop"), as vLLM and the
// llama.cpp server do it: text is released as soon as no stop string can begin in it.
//
// State: `pending`, the text fed but not yet released, which is always shorter than the longest
// stop string (anything longer would either contain a complete stop string — found — or start
// with a character that cannot begin one — released). On each feed:
//   1. append the fragment to pending and look for every stop string in it; the match that ends
//      first wins (ties: the one that starts first, i.e. the longer one). Because pending had no
//      complete match before, the first occurrence of each string is new.
//   2. no match: hold back the longest suffix of pending that is a proper prefix of some stop
//      string, release the rest.
// Work per feed is O(n_stops × (fragment + longest stop)). Byte-based: for valid UTF-8 input a
// held-back suffix starts where a stop string starts, so it never splits a character.
#include <string.h>

#include "tok/tok_impl.h"

struct pd_tok_stop {
    char **stops;   // owned, n
    size_t *lens;   // owned, n
    int n;
    size_t max_len;
    bool include_stop;
    pd_buf pending;
    pd_buf out;     // what the last call released
    size_t base;        // offset of pending[0] in all text fed
    bool stopped;
    int stop_idx;
    size_t stop_pos;
};

pd_tok_stop *pd_tok_stop_new(const char *const *stops, int n_stops, bool include_stop, pd_err *err) {
    if (n_stops < 0 || (n_stops > 0 && !stops)) {
        pd_err_set(err, PD_ERR_INVALID, "stop strings: bad arguments");
        return NULL;
    }
    for (int i = 0; i < n_stops; i++) {
        if (!stops[i] || !stops[i][0]) {
            pd_err_set(err, PD_ERR_INVALID, "stop string %d is empty", i);
            return NULL;
        }
    }
    pd_tok_stop *s = pd_calloc(1, sizeof(*s));
    if (!s) goto nomem;
    s->include_stop = include_stop;
    s->stop_idx = -1;
    s->stops = pd_calloc((size_t)(n_stops ? n_stops : 1), sizeof(char *));
    s->lens = pd_calloc((size_t)(n_stops ? n_stops : 1), sizeof(size_t));
    if (!s->stops || !s->lens) goto nomem;
    for (int i = 0; i < n_stops; i++) {
        s->stops[i] = pd_strdup(stops[i]);
        if (!s->stops[i]) goto nomem;
        s->n++;
        s->lens[i] = strlen(stops[i]);
        s->max_len = PD_MAX(s->max_len, s->lens[i]);
    }
    return s;
nomem:
    pd_tok_stop_free(s);
    pd_err_set(err, PD_ERR_NOMEM, "stop strings: out of memory");
    return NULL;
}

void pd_tok_stop_free(pd_tok_stop *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) pd_free(s->stops[i]);
    pd_free(s->stops);
    pd_free(s->lens);
    pd_buf_free(&s->pending);
    pd_buf_free(&s->out);
    pd_free(s);
}

static void fill(pd_tok_stop *s, pd_tok_stop_result *res) {
    res->text = s->out.p ? s->out.p : "";
    res->len = s->out.len;
    res->is_stopped = s->stopped;
    res->stop_idx = s->stop_idx;
    res->stop_pos = s->stop_pos;
}

// Releases pending[0..n) into out and drops it from pending.
static pd_status release(pd_tok_stop *s, size_t n) {
    if (pd_buf_append(&s->out, s->pending.p, n) != PD_OK) return PD_ERR_NOMEM;
    memmove(s->pending.p, s->pending.p + n, s->pending.len - n);
    s->pending.len -= n;
    s->base += n;
    return PD_OK;
}

// Longest suffix of pending that is a proper prefix of a stop string.
static size_t held_suffix(const pd_tok_stop *s) {
    size_t len = s->pending.len;
    for (size_t k = PD_MIN(len, s->max_len ? s->max_len - 1 : 0); k > 0; k--) {
        const char *suf = s->pending.p + len - k;
        for (int i = 0; i < s->n; i++) {
            if (s->lens[i] > k && memcmp(s->stops[i], suf, k) == 0) return k;
        }
    }
    return 0;
}

pd_status pd_tok_stop_feed(pd_tok_stop *s, const char *text, size_t len, pd_tok_stop_result *res) {
    s->out.len = 0;
    pd_status st = PD_OK;
    if (!s->stopped && len > 0) st = pd_buf_append(&s->pending, text, len);
    if (st == PD_OK && !s->stopped && s->pending.len > 0) {
        size_t best_start = 0, best_end = SIZE_MAX;
        int best = -1;
        for (int i = 0; i < s->n; i++) {
            const char *f = memmem(s->pending.p, s->pending.len, s->stops[i], s->lens[i]);
            if (!f) continue;
            size_t a = (size_t)(f - s->pending.p), b = a + s->lens[i];
            if (b < best_end || (b == best_end && a < best_start)) best = i, best_start = a, best_end = b;
        }
        if (best >= 0) {
            s->stopped = true;
            s->stop_idx = best;
            s->stop_pos = s->base + best_start;
            st = release(s, s->include_stop ? best_end : best_start);
            s->pending.len = 0;
        } else {
            st = release(s, s->pending.len - held_suffix(s));
        }
    }
    if (st != PD_OK) s->out.len = 0;
    if (s->out.p) s->out.p[s->out.len] = 0;
    fill(s, res);
    return st;
}

pd_status pd_tok_stop_finish(pd_tok_stop *s, pd_tok_stop_result *res) {
    s->out.len = 0;
    pd_status st = PD_OK;
    if (!s->stopped && s->pending.len) st = release(s, s->pending.len);
    if (st != PD_OK) s->out.len = 0;
    if (s->out.p) s->out.p[s->out.len] = 0;
    fill(s, res);
    return st;
}
