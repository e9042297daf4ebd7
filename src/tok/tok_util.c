// tok_util.c — small building blocks of the tokenizer: hash maps keyed by strings and by id
// pairs, UTF-8 validation and lossy decoding rules, a growable byte buffer.
//
// The string map stores values only (8 bytes a slot: value + 32-bit hash); keys live in the
// caller's pool and are found through the value (see pd_tok_smap in tok_impl.h). Both maps use
// open addressing with linear probing, grown at 3/4 load. Nothing here is thread-aware: maps are
// filled at load time (then read-only) or are per-call.
#include <string.h>
#include <xxhash.h>

#include "tok/tok_impl.h"

uint64_t pd_tok_hash(const char *s, size_t n) { return XXH3_64bits(s, n); }

// ---- string map ------------------------------------------------------------------------------

int32_t pd_tok_smap_get(const pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                        const uint32_t *key_len, const char *key, size_t n) {
    if (m->cap == 0) return -1;
    uint32_t h = (uint32_t)pd_tok_hash(key, n), mask = m->cap - 1;
    for (uint32_t i = h & mask;; i = (i + 1) & mask) {
        int32_t v = m->vals[i];
        if (v < 0) return -1;
        if (m->hashes[i] == h && key_len[v] == n && memcmp(pool + key_off[v], key, n) == 0) return v;
    }
}

static pd_status smap_grow(pd_tok_smap *m) {
    uint32_t cap = m->cap ? m->cap * 2 : 64;
    int32_t *vals = pd_malloc((size_t)cap * sizeof(*vals));
    uint32_t *hashes = pd_malloc((size_t)cap * sizeof(*hashes));
    if (!vals || !hashes) {
        pd_free(vals);
        pd_free(hashes);
        return PD_ERR_NOMEM;
    }
    memset(vals, 0xff, (size_t)cap * sizeof(*vals));
    for (uint32_t i = 0; i < m->cap; i++) {
        if (m->vals[i] < 0) continue;
        uint32_t j = m->hashes[i] & (cap - 1);
        while (vals[j] >= 0) j = (j + 1) & (cap - 1);
        vals[j] = m->vals[i];
        hashes[j] = m->hashes[i];
    }
    pd_free(m->vals);
    pd_free(m->hashes);
    m->vals = vals;
    m->hashes = hashes;
    m->cap = cap;
    return PD_OK;
}

pd_status pd_tok_smap_put(pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                          const uint32_t *key_len, int32_t v) {
    if ((m->n + 1) * 4 > m->cap * 3) {
        pd_status st = smap_grow(m);
        if (st != PD_OK) return st;
    }
    const char *key = pool + key_off[v];
    size_t n = key_len[v];
    uint32_t h = (uint32_t)pd_tok_hash(key, n), mask = m->cap - 1;
    uint32_t i = h & mask;
    for (; m->vals[i] >= 0; i = (i + 1) & mask) {
        int32_t w = m->vals[i];
        if (m->hashes[i] == h && key_len[w] == n && memcmp(pool + key_off[w], key, n) == 0) {
            return PD_OK;
        }
    }
    m->vals[i] = v;
    m->hashes[i] = h;
    m->n++;
    return PD_OK;
}

void pd_tok_smap_fini(pd_tok_smap *m) {
    pd_free(m->vals);
    pd_free(m->hashes);
    memset(m, 0, sizeof(*m));
}

// ---- pair map ----------------------------------------------------------------------------------

static inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

bool pd_tok_pmap_get(const pd_tok_pmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id) {
    if (m->cap == 0) return false;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = m->cap - 1;
    for (uint32_t i = (uint32_t)mix64(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == UINT64_MAX) return false;
        if (m->keys[i] == key) {
            *rank = m->ranks[i];
            *id = m->ids[i];
            return true;
        }
    }
}

static pd_status pmap_grow(pd_tok_pmap *m) {
    uint32_t cap = m->cap ? m->cap * 2 : 64;
    uint64_t *keys = pd_malloc((size_t)cap * sizeof(*keys));
    int32_t *ranks = pd_malloc((size_t)cap * sizeof(*ranks));
    int32_t *ids = pd_malloc((size_t)cap * sizeof(*ids));
    if (!keys || !ranks || !ids) {
        pd_free(keys);
        pd_free(ranks);
        pd_free(ids);
        return PD_ERR_NOMEM;
    }
    memset(keys, 0xff, (size_t)cap * sizeof(*keys));
    for (uint32_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == UINT64_MAX) continue;
        uint32_t j = (uint32_t)mix64(m->keys[i]) & (cap - 1);
        while (keys[j] != UINT64_MAX) j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        ranks[j] = m->ranks[i];
        ids[j] = m->ids[i];
    }
    pd_free(m->keys);
    pd_free(m->ranks);
    pd_free(m->ids);
    m->keys = keys;
    m->ranks = ranks;
    m->ids = ids;
    m->cap = cap;
    return PD_OK;
}

pd_status pd_tok_pmap_put(pd_tok_pmap *m, int32_t a, int32_t b, int32_t rank, int32_t id) {
    if ((m->n + 1) * 4 > m->cap * 3) {
        pd_status st = pmap_grow(m);
        if (st != PD_OK) return st;
    }
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = m->cap - 1, i = (uint32_t)mix64(key) & mask;
    for (; m->keys[i] != UINT64_MAX; i = (i + 1) & mask) {
        if (m->keys[i] == key) return PD_OK;
    }
    m->keys[i] = key;
    m->ranks[i] = rank;
    m->ids[i] = id;
    m->n++;
    return PD_OK;
}

void pd_tok_pmap_fini(pd_tok_pmap *m) {
    pd_free(m->keys);
    pd_free(m->ranks);
    pd_free(m->ids);
    memset(m, 0, sizeof(*m));
}

// ---- UTF-8 -----------------------------------------------------------------------------------
// Well-formed sequences, Unicode table 3-7. For a lead byte, the range its second byte must lie
// in; later bytes are always 80..BF.

static int utf8_need(unsigned char c, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xbf;
    if (c < 0x80) return 1;
    if (c < 0xc2) return 0;
    if (c < 0xe0) return 2;
    if (c < 0xf0) {
        if (c == 0xe0) *lo = 0xa0;
        if (c == 0xed) *hi = 0x9f;
        return 3;
    }
    if (c < 0xf5) {
        if (c == 0xf0) *lo = 0x90;
        if (c == 0xf4) *hi = 0x8f;
        return 4;
    }
    return 0;
}

int pd_tok_utf8_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    unsigned char lo, hi;
    int need = utf8_need(s[0], &lo, &hi);
    if (need <= 1) return need;
    if ((size_t)need > n) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < need; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
    }
    return need;
}

int pd_tok_utf8_invalid_len(const unsigned char *s, size_t n, bool more_may_come) {
    unsigned char lo, hi;
    int need = utf8_need(s[0], &lo, &hi);
    if (need == 0) return 1;
    int k = 1;
    for (; k < need; k++) {
        if ((size_t)k >= n) return more_may_come ? 0 : k;
        unsigned char c = s[k];
        bool ok = k == 1 ? (c >= lo && c <= hi) : (c & 0xc0) == 0x80;
        if (!ok) break;
    }
    return k;
}

bool pd_tok_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        int l = pd_tok_utf8_len(p + i, n - i);
        if (l == 0) return false;
        i += (size_t)l;
    }
    return true;
}

int pd_tok_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    int l = pd_tok_utf8_len(s, n);
    switch (l) {
    case 1: *cp = s[0]; break;
    case 2: *cp = ((uint32_t)(s[0] & 0x1f) << 6) | (s[1] & 0x3f); break;
    case 3: *cp = ((uint32_t)(s[0] & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f); break;
    case 4:
        *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3f) << 12) |
              ((uint32_t)(s[2] & 0x3f) << 6) | (s[3] & 0x3f);
        break;
    default: *cp = 0xfffd; return 1;
    }
    return l;
}

int pd_tok_utf8_encode(uint32_t cp, char out[4]) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

bool pd_tok_is_space(uint32_t cp) {
    if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0d);
    if (cp < 0x85) return false;
    return cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

bool pd_tok_byte_token(const char *s, size_t n, uint8_t *out) {
    // HF ByteFallback: len 6, "<0x" .. ">", and u8::from_str_radix(s[3..5], 16) succeeds.
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
    int v = 0, k = 3;
    if (s[3] == '+') k = 4;
    for (; k < 5; k++) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v * 16 + d;
    }
    *out = (uint8_t)v;
    return true;
}

// ---- buffer ------------------------------------------------------------------------------------

pd_status pd_tok_buf_reserve(pd_tok_buf *b, size_t extra) {
    size_t need;
    if (pd_add_overflow(b->len, extra + 1, &need)) return PD_ERR_NOMEM;
    if (need <= b->cap) return PD_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    char *p = pd_realloc(b->p, cap);
    if (!p) return PD_ERR_NOMEM;
    b->p = p;
    b->cap = cap;
    return PD_OK;
}

pd_status pd_tok_buf_add(pd_tok_buf *b, const void *s, size_t n) {
    if (pd_tok_buf_reserve(b, n) != PD_OK) return PD_ERR_NOMEM;
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return PD_OK;
}

void pd_tok_buf_fini(pd_tok_buf *b) {
    pd_free(b->p);
    memset(b, 0, sizeof(*b));
}

// ---- id vector (public) ------------------------------------------------------------------------

void pd_tok_ids_free(pd_tok_ids *v) {
    if (!v) return;
    pd_free(v->ids);
    memset(v, 0, sizeof(*v));
}

pd_status pd_tok_ids_push(pd_tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        if (v->cap > INT32_MAX / 2) return PD_ERR_NOMEM;
        int cap = v->cap ? v->cap * 2 : 64;
        int32_t *ids = pd_realloc(v->ids, (size_t)cap * sizeof(*ids));
        if (!ids) return PD_ERR_NOMEM;
        v->ids = ids;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return PD_OK;
}
