// tok_nfc.c — Unicode NFC for the NFC normalizer (Qwen2 and others), UAX #15:
// full canonical decomposition (tables + Hangul arithmetic), canonical reordering by combining
// class, then canonical composition of unblocked pairs. Tables are generated into
// tok_nfc_data.c by tools/gen_nfc_tables.py.
//
// Text made only of code points below U+0300 is already NFC (nothing there decomposes into, or
// composes with, anything below U+0300), so it is copied as is: the common case costs one scan.
// NOTE: the tables follow Python's Unicode version (see tok_nfc_data.c); HF's unicode-
// normalization crate may know a few newer characters.
#include <string.h>

#include "tok/tok_impl.h"

extern const uint32_t pd_tok_nfc_ccc[][3];
extern const int pd_tok_nfc_n_ccc;
extern const uint32_t pd_tok_nfc_decomp[][3];
extern const int pd_tok_nfc_n_decomp;
extern const uint32_t pd_tok_nfc_comp[][3];
extern const int pd_tok_nfc_n_comp;

enum { S_BASE = 0xAC00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11A7 };
enum { L_COUNT = 19, V_COUNT = 21, T_COUNT = 28, N_COUNT = V_COUNT * T_COUNT, S_COUNT = L_COUNT * N_COUNT };

static int ccc_of(uint32_t cp) {
    if (cp < 0x300) return 0;
    int lo = 0, hi = pd_tok_nfc_n_ccc - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < pd_tok_nfc_ccc[mid][0]) hi = mid - 1;
        else if (cp > pd_tok_nfc_ccc[mid][1]) lo = mid + 1;
        else return (int)pd_tok_nfc_ccc[mid][2];
    }
    return 0;
}

static int decomp_idx(uint32_t cp) {
    int lo = 0, hi = pd_tok_nfc_n_decomp - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < pd_tok_nfc_decomp[mid][0]) hi = mid - 1;
        else if (cp > pd_tok_nfc_decomp[mid][0]) lo = mid + 1;
        else return mid;
    }
    return -1;
}

static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= L_BASE && a < L_BASE + L_COUNT && b >= V_BASE && b < V_BASE + V_COUNT) {
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    }
    if (a >= S_BASE && a < S_BASE + S_COUNT && (a - S_BASE) % T_COUNT == 0 && b > T_BASE &&
        b < T_BASE + T_COUNT) {
        return a + (b - T_BASE);
    }
    int lo = 0, hi = pd_tok_nfc_n_comp - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        const uint32_t *e = pd_tok_nfc_comp[mid];
        if (a < e[0] || (a == e[0] && b < e[1])) hi = mid - 1;
        else if (a > e[0] || b > e[1]) lo = mid + 1;
        else return e[2];
    }
    return 0;
}

typedef struct cps {
    uint32_t *p;
    size_t n, cap;
} cps;

static pd_status cps_push(cps *v, uint32_t cp) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        uint32_t *p = pd_realloc(v->p, cap * sizeof(uint32_t));
        if (!p) return PD_ERR_NOMEM;
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = cp;
    return PD_OK;
}

static pd_status decompose(uint32_t cp, cps *out, int depth) {
    if (cp >= S_BASE && cp < S_BASE + S_COUNT) {
        uint32_t s = cp - S_BASE, t = s % T_COUNT;
        if (cps_push(out, L_BASE + s / N_COUNT) != PD_OK) return PD_ERR_NOMEM;
        if (cps_push(out, V_BASE + (s % N_COUNT) / T_COUNT) != PD_OK) return PD_ERR_NOMEM;
        return t ? cps_push(out, T_BASE + t) : PD_OK;
    }
    int k = cp >= 0xC0 && depth < 8 ? decomp_idx(cp) : -1;
    if (k < 0) return cps_push(out, cp);
    if (decompose(pd_tok_nfc_decomp[k][1], out, depth + 1) != PD_OK) return PD_ERR_NOMEM;
    return pd_tok_nfc_decomp[k][2] ? decompose(pd_tok_nfc_decomp[k][2], out, depth + 1) : PD_OK;
}

// Canonical ordering: stable sort of each run of non-starters by combining class.
static void reorder(cps *v) {
    for (size_t i = 1; i < v->n; i++) {
        uint32_t c = v->p[i];
        int cc = ccc_of(c);
        if (cc == 0) continue;
        size_t j = i;
        while (j > 0) {
            int pc = ccc_of(v->p[j - 1]);
            if (pc == 0 || pc <= cc) break;
            v->p[j] = v->p[j - 1];
            j--;
        }
        v->p[j] = c;
    }
}

// Canonical composition, in place.
static void compose_all(cps *v) {
    size_t out = 0;
    int64_t starter = -1;
    int last_cc = 0;
    for (size_t i = 0; i < v->n; i++) {
        uint32_t c = v->p[i];
        int cc = ccc_of(c);
        if (starter >= 0) {
            bool adjacent = (int64_t)out - 1 == starter;
            if (adjacent || (last_cc != 0 && last_cc < cc)) {
                uint32_t k = compose(v->p[starter], c);
                if (k) {
                    v->p[starter] = k;
                    continue;
                }
            }
        }
        if (cc == 0) starter = (int64_t)out;
        last_cc = cc;
        v->p[out++] = c;
    }
    v->n = out;
}

pd_status pd_tok_nfc(const char *s, size_t n, pd_buf *out) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n && (p[i] < 0xcc)) i++;  // bytes below 0xCC start code points below U+0300
    if (i == n) return pd_buf_append(out, s, n);
    cps v = {0};
    pd_status st = PD_OK;
    for (i = 0; i < n && st == PD_OK;) {
        uint32_t cp;
        i += (size_t)pd_tok_utf8_decode(p + i, n - i, &cp);
        st = decompose(cp, &v, 0);
    }
    if (st == PD_OK) {
        reorder(&v);
        compose_all(&v);
        char enc[4];
        for (size_t k = 0; k < v.n && st == PD_OK; k++) st = pd_buf_append(out, enc, (size_t)pd_tok_utf8_encode(v.p[k], enc));
    }
    pd_free(v.p);
    return st;
}
