// tok_util.c — small building blocks of the tokenizer: the maps keyed by strings and by id pairs
// (both pd_map, base/map.h, grown at 3/4 load), UTF-8 validation and lossy decoding rules.
//
// The string map stores values only; keys live in the caller's pool and are found through the
// value (see pd_tok_smap in tok_impl.h). Nothing here is thread-aware: maps are filled at load
// time (then read-only) or are per-call.
#include <string.h>
#include <xxhash.h>

#include "tok/tok_impl.h"

uint64_t pd_tok_hash(const char *s, size_t n) { return XXH3_64bits(s, n); }

// ---- string map ------------------------------------------------------------------------------

typedef struct skey {  // a lookup key and where the stored values' keys live
    const char *pool;
    const uint32_t *off, *len;
    const char *s;
    size_t n;
} skey;

static bool smap_eq(const void *entry, const void *key, void *ctx) {
    const skey *k = key;
    int32_t v;
    memcpy(&v, entry, sizeof v);
    return k->len[v] == k->n && memcmp(k->pool + k->off[v], k->s, k->n) == 0;
}

static const pd_map_params smap_params = {.entry_size = sizeof(int32_t), .eq = smap_eq, .max_load_pct = 75};

int32_t pd_tok_smap_get(const pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                        const uint32_t *key_len, const char *key, size_t n) {
    if (!m->map.cap) return -1;
    skey k = {pool, key_off, key_len, key, n};
    const int32_t *e = pd_map_find(&m->map, pd_tok_hash(key, n), &k);
    return e ? *e : -1;
}

pd_status pd_tok_smap_put(pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                          const uint32_t *key_len, int32_t v) {
    if (!m->map.stride) PD_ASSERT(pd_map_init(&m->map, &smap_params) == PD_OK);
    skey k = {pool, key_off, key_len, pool + key_off[v], key_len[v]};
    bool existed;
    int32_t *e = pd_map_put(&m->map, pd_tok_hash(k.s, k.n), &k, &existed);
    if (!e) return PD_ERR_NOMEM;
    if (!existed) *e = v;
    return PD_OK;
}

void pd_tok_smap_fini(pd_tok_smap *m) {
    pd_map_fini(&m->map);
    memset(m, 0, sizeof(*m));
}

// ---- pair map ----------------------------------------------------------------------------------

typedef struct pd_tok_pmap_entry {
    uint64_t key;  // (left << 32) | right
    int32_t rank, id;
} pd_tok_pmap_entry;

static const pd_map_params pmap_params = {.entry_size = sizeof(pd_tok_pmap_entry), .key_size = 8, .max_load_pct = 75};

bool pd_tok_pmap_get(const pd_tok_pmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id) {
    if (!m->map.cap) return false;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    const pd_tok_pmap_entry *e = pd_map_find(&m->map, pd_map_mix64(key), &key);
    if (!e) return false;
    *rank = e->rank;
    *id = e->id;
    return true;
}

pd_status pd_tok_pmap_put(pd_tok_pmap *m, int32_t a, int32_t b, int32_t rank, int32_t id) {
    if (!m->map.stride) PD_ASSERT(pd_map_init(&m->map, &pmap_params) == PD_OK);
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    bool existed;
    pd_tok_pmap_entry *e = pd_map_put(&m->map, pd_map_mix64(key), &key, &existed);
    if (!e) return PD_ERR_NOMEM;
    if (!existed) {
        e->rank = rank;
        e->id = id;
    }
    return PD_OK;
}

void pd_tok_pmap_fini(pd_tok_pmap *m) {
    pd_map_fini(&m->map);
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

// ---- id vector (public) ------------------------------------------------------------------------

void pd_tok_ids_free(pd_tok_ids *v) {
    if (!v) return;
    pd_free(v->ids);
    memset(v, 0, sizeof(*v));
}

pd_status pd_tok_ids_push(pd_tok_ids *v, int32_t id) {
    if (v->n == INT32_MAX) return PD_ERR_NOMEM;
    pd_status st = PD_ARRAY_RESERVE(v->ids, v->cap, (size_t)v->n + 1);
    if (st != PD_OK) return st;
    v->ids[v->n++] = id;
    return PD_OK;
}
