// page.c — the KV tier page: header, quantisation (bf16 / fp8 e4m3 / int8 with per-head scales)
// and the XXH3-64 checksum. See kvtier.h for the format.
//
// Header (PD_KVT_HDR_BYTES, all little-endian):
//    0 u32 magic   4 u32 version   8 u32 dtype   12 u32 n_layers   16 u32 n_kv_heads
//   20 u32 head_dim 24 u32 block_size 28 u32 reserved (0)   32 u64 fingerprint
//   40 u64 hash.lo 48 u64 hash.hi 56 u64 parent.lo 64 u64 parent.hi 72 u64 payload_bytes
//   80 u64 reserved (0)   88 u64 checksum = XXH3_64(header[0..88) || payload)
#include <math.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "kvtier/kvtier.h"

pd_kvt_dtype pd_kvt_dtype_parse(const char *s) {
    if (!s) return 0;
    if (!strcmp(s, "f32") || !strcmp(s, "fp32")) return PD_KVT_F32;
    if (!strcmp(s, "bf16")) return PD_KVT_BF16;
    if (!strcmp(s, "fp8")) return PD_KVT_FP8;
    if (!strcmp(s, "int8")) return PD_KVT_INT8;
    return 0;
}

const char *pd_kvt_dtype_name(pd_kvt_dtype d) {
    switch (d) {
    case PD_KVT_F32: return "f32";
    case PD_KVT_BF16: return "bf16";
    case PD_KVT_FP8: return "fp8";
    case PD_KVT_INT8: return "int8";
    }
    return "?";
}

static size_t elem_bytes(pd_kvt_dtype d) {
    switch (d) {
    case PD_KVT_F32: return 4;
    case PD_KVT_BF16: return 2;
    case PD_KVT_FP8:
    case PD_KVT_INT8: return 1;
    }
    return 0;
}

static bool geom_ok(const pd_kvt_geom *g) {
    return g && g->n_layers > 0 && g->n_layers <= 4096 && g->n_kv_heads > 0 && g->n_kv_heads <= 1024 &&
           g->head_dim > 0 && g->head_dim <= 4096 && g->block_size > 0 && g->block_size <= 4096;
}

static size_t payload_bytes(const pd_kvt_geom *g, pd_kvt_dtype d) {
    size_t e = elem_bytes(d);
    if (!e || !geom_ok(g)) return 0;
    size_t per_head = 4 + (size_t)g->block_size * (size_t)g->head_dim * e;
    return (size_t)g->n_layers * 2 * (size_t)g->n_kv_heads * per_head;
}

size_t pd_kvt_page_bytes(const pd_kvt_geom *g, pd_kvt_dtype d) {
    size_t p = payload_bytes(g, d);
    return p ? PD_KVT_HDR_BYTES + p : 0;
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

// ---- element codecs ------------------------------------------------------------------------------
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    uint32_t round = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (uint16_t)((u + round) >> 16);
}
static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// e4m3fn: bias 7, no infinities, max 448 (0x7e); subnormals step 2^-9. x is already scaled.
static uint8_t f32_to_fp8(float x) {
    uint8_t sign = (x < 0) ? 0x80 : 0;
    float a = fabsf(x);
    if (!(a == a)) return 0x7f;  // NaN
    if (a >= 448.0f) return sign | 0x7e;
    if (a < 0.015625f) {  // below 2^-6: subnormal, m in 0..8 (8 rolls into the smallest normal)
        int m = (int)nearbyintf(a * 512.0f);
        return sign | (uint8_t)m;
    }
    int e;
    float fr = frexpf(a, &e);  // a = fr * 2^e, fr in [0.5, 1)
    e -= 1;                    // a = (2 fr) * 2^e, 2 fr in [1, 2)
    int q = (int)nearbyintf((2.0f * fr - 1.0f) * 8.0f);
    if (q == 8) {
        q = 0;
        e++;
    }
    int be = e + 7;
    if (be > 15 || (be == 15 && q > 6)) return sign | 0x7e;
    return sign | (uint8_t)(be << 3) | (uint8_t)q;
}
static float fp8_to_f32(uint8_t b) {
    int e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 0) v = (float)m / 512.0f;
    else if (e == 15 && m == 7) v = NAN;
    else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

// One head's block_size x head_dim values (row stride `stride` floats) into dst: scale then values.
static uint8_t *encode_head(pd_kvt_dtype d, const float *src, int bs, int hd, size_t stride, uint8_t *dst) {
    float amax = 0;
    for (int t = 0; t < bs; t++)
        for (int i = 0; i < hd; i++) {
            float a = fabsf(src[(size_t)t * stride + (size_t)i]);
            if (a > amax) amax = a;
        }
    float scale = 1.0f;
    if (d == PD_KVT_INT8 && amax > 0) scale = amax / 127.0f;
    if (d == PD_KVT_FP8 && amax > 0) scale = amax / 448.0f;
    uint32_t su;
    memcpy(&su, &scale, 4);
    put32(dst, su);
    dst += 4;
    float inv = 1.0f / scale;
    for (int t = 0; t < bs; t++) {
        const float *r = src + (size_t)t * stride;
        for (int i = 0; i < hd; i++) {
            float x = r[i];
            switch (d) {
            case PD_KVT_F32: {
                uint32_t u;
                memcpy(&u, &x, 4);
                put32(dst, u);
                dst += 4;
                break;
            }
            case PD_KVT_BF16: {
                uint16_t h = f32_to_bf16(x);
                dst[0] = (uint8_t)h;
                dst[1] = (uint8_t)(h >> 8);
                dst += 2;
                break;
            }
            case PD_KVT_FP8: *dst++ = f32_to_fp8(x * inv); break;
            case PD_KVT_INT8: {
                float q = nearbyintf(x * inv);
                if (q > 127) q = 127;
                if (q < -127) q = -127;
                *dst++ = (uint8_t)(int8_t)q;
                break;
            }
            }
        }
    }
    return dst;
}

static const uint8_t *decode_head(pd_kvt_dtype d, const uint8_t *src, int bs, int hd, size_t stride, float *dst) {
    uint32_t su = get32(src);
    float scale;
    memcpy(&scale, &su, 4);
    src += 4;
    for (int t = 0; t < bs; t++) {
        float *r = dst + (size_t)t * stride;
        for (int i = 0; i < hd; i++) {
            switch (d) {
            case PD_KVT_F32: {
                uint32_t u = get32(src);
                memcpy(&r[i], &u, 4);
                src += 4;
                break;
            }
            case PD_KVT_BF16:
                r[i] = bf16_to_f32((uint16_t)(src[0] | (src[1] << 8)));
                src += 2;
                break;
            case PD_KVT_FP8: r[i] = fp8_to_f32(*src++) * scale; break;
            case PD_KVT_INT8: r[i] = (float)(int8_t)*src++ * scale; break;
            }
        }
    }
    return src;
}

static void write_header(uint8_t *h, const pd_kvt_geom *g, pd_kvt_dtype d, uint64_t fingerprint, pd_hash128 hash,
                         pd_hash128 parent, size_t pb);
static void write_checksum(uint8_t *h, size_t pb) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, h, 88);
    XXH3_64bits_update(&st, h + PD_KVT_HDR_BYTES, pb);
    put64(h + 88, XXH3_64bits_digest(&st));
}

pd_status pd_kvt_page_encode_bf16(const pd_kvt_geom *g, uint64_t fingerprint, pd_hash128 hash, pd_hash128 parent,
                                  const uint16_t *const *k, const uint16_t *const *v, void *out, size_t out_len) {
    size_t pb = payload_bytes(g, PD_KVT_BF16);
    if (!pb || !k || !v || !out || out_len != PD_KVT_HDR_BYTES + pb) return PD_ERR_INVALID;
    for (int l = 0; l < g->n_layers; l++)
        if (!k[l] || !v[l]) return PD_ERR_INVALID;
    uint8_t *h = out;
    write_header(h, g, PD_KVT_BF16, fingerprint, hash, parent, pb);
    uint8_t *p = h + PD_KVT_HDR_BYTES;
    size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim, hb = (size_t)g->head_dim * 2;
    float one = 1.0f;  // a bf16 page's scale (as encode_head writes it)
    uint32_t one_u;
    memcpy(&one_u, &one, 4);
    for (int l = 0; l < g->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int hh = 0; hh < g->n_kv_heads; hh++) {
                const uint16_t *src = (kv ? v[l] : k[l]) + (size_t)hh * (size_t)g->head_dim;
                put32(p, one_u);
                p += 4;
                for (int t = 0; t < g->block_size; t++, p += hb) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                    memcpy(p, src + (size_t)t * row, hb);  // the page's little-endian bf16, as is
#else
                    for (int i = 0; i < g->head_dim; i++) {
                        uint16_t x = src[(size_t)t * row + (size_t)i];
                        p[2 * i] = (uint8_t)x, p[2 * i + 1] = (uint8_t)(x >> 8);
                    }
#endif
                }
            }
    write_checksum(h, pb);
    return PD_OK;
}

pd_status pd_kvt_page_encode(const pd_kvt_geom *g, pd_kvt_dtype d, uint64_t fingerprint, pd_hash128 hash,
                             pd_hash128 parent, const float *const *k, const float *const *v, void *out,
                             size_t out_len) {
    size_t pb = payload_bytes(g, d);
    if (!pb || !k || !v || !out || out_len != PD_KVT_HDR_BYTES + pb) return PD_ERR_INVALID;
    uint8_t *h = out;
    write_header(h, g, d, fingerprint, hash, parent, pb);
    uint8_t *p = h + PD_KVT_HDR_BYTES;
    size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    for (int l = 0; l < g->n_layers; l++)
        if (!k[l] || !v[l]) return PD_ERR_INVALID;
    // Every (layer, K/V, head) segment has the same size. (Serial: an OpenMP version was slower on
    // the GPU host, whose cores the engine, HTTP and client threads keep busy.)
    size_t seg = 4 + (size_t)g->block_size * (size_t)g->head_dim * elem_bytes(d);
    int n_seg = g->n_layers * 2 * g->n_kv_heads;
    for (int s = 0; s < n_seg; s++) {
        int l = s / (2 * g->n_kv_heads), kv = (s / g->n_kv_heads) % 2, hh = s % g->n_kv_heads;
        const float *base = kv ? v[l] : k[l];
        encode_head(d, base + (size_t)hh * g->head_dim, g->block_size, g->head_dim, row, p + (size_t)s * seg);
    }
    write_checksum(h, pb);
    return PD_OK;
}

static void write_header(uint8_t *h, const pd_kvt_geom *g, pd_kvt_dtype d, uint64_t fingerprint, pd_hash128 hash,
                         pd_hash128 parent, size_t pb) {
    memset(h, 0, PD_KVT_HDR_BYTES);
    put32(h + 0, PD_KVT_PAGE_MAGIC);
    put32(h + 4, PD_KVT_PAGE_VERSION);
    put32(h + 8, (uint32_t)d);
    put32(h + 12, (uint32_t)g->n_layers);
    put32(h + 16, (uint32_t)g->n_kv_heads);
    put32(h + 20, (uint32_t)g->head_dim);
    put32(h + 24, (uint32_t)g->block_size);
    put64(h + 32, fingerprint);
    put64(h + 40, hash.lo);
    put64(h + 48, hash.hi);
    put64(h + 56, parent.lo);
    put64(h + 64, parent.hi);
    put64(h + 72, (uint64_t)pb);
}

// The header alone (the first PD_KVT_HDR_BYTES of page): magic, version, geometry, fingerprint,
// expected hash; fills *in. Reads nothing past the header.
static pd_kvt_bad header_check(const uint8_t *h, uint64_t fingerprint, const pd_kvt_geom *g, const pd_hash128 *expect_hash,
                               pd_kvt_page_info *in, size_t *want) {
    if (get32(h) != PD_KVT_PAGE_MAGIC || get32(h + 4) != PD_KVT_PAGE_VERSION) return PD_KVT_BAD_FOREIGN;
    in->dtype = (pd_kvt_dtype)get32(h + 8);
    in->geom.n_layers = (int)get32(h + 12);
    in->geom.n_kv_heads = (int)get32(h + 16);
    in->geom.head_dim = (int)get32(h + 20);
    in->geom.block_size = (int)get32(h + 24);
    in->fingerprint = get64(h + 32);
    in->hash.lo = get64(h + 40);
    in->hash.hi = get64(h + 48);
    in->parent.lo = get64(h + 56);
    in->parent.hi = get64(h + 64);
    in->payload_bytes = get64(h + 72);
    *want = payload_bytes(&in->geom, in->dtype);
    if (!*want) return PD_KVT_BAD_FOREIGN;
    if (in->fingerprint != fingerprint) return PD_KVT_BAD_FOREIGN;
    if (g && (g->n_layers != in->geom.n_layers || g->n_kv_heads != in->geom.n_kv_heads ||
              g->head_dim != in->geom.head_dim || g->block_size != in->geom.block_size))
        return PD_KVT_BAD_FOREIGN;
    if (expect_hash && !pd_hash128_eq(*expect_hash, in->hash)) return PD_KVT_BAD_FOREIGN;
    if (in->payload_bytes != *want) return PD_KVT_BAD_TRUNCATED;
    return PD_KVT_PAGE_OK;
}

pd_kvt_bad pd_kvt_page_check_header(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                                    const pd_hash128 *expect_hash, pd_kvt_page_info *info) {
    if (!page || len < PD_KVT_HDR_BYTES) return PD_KVT_BAD_TRUNCATED;
    pd_kvt_page_info in;
    size_t want;
    pd_kvt_bad bad = header_check(page, fingerprint, g, expect_hash, &in, &want);
    if (bad == PD_KVT_PAGE_OK && info) *info = in;
    return bad;
}

pd_kvt_bad pd_kvt_page_check(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                             const pd_hash128 *expect_hash, pd_kvt_page_info *info) {
    const uint8_t *h = page;
    if (!page || len < PD_KVT_HDR_BYTES) return PD_KVT_BAD_TRUNCATED;
    pd_kvt_page_info in;
    size_t want;
    pd_kvt_bad bad = header_check(h, fingerprint, g, expect_hash, &in, &want);
    if (bad) return bad;
    if (len != PD_KVT_HDR_BYTES + want) return PD_KVT_BAD_TRUNCATED;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, h, 88);
    XXH3_64bits_update(&st, h + PD_KVT_HDR_BYTES, want);
    if (XXH3_64bits_digest(&st) != get64(h + 88)) return PD_KVT_BAD_CHECKSUM;
    if (info) *info = in;
    return PD_KVT_PAGE_OK;
}

pd_kvt_bad pd_kvt_page_decode_bf16(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                                   pd_hash128 expect_hash, uint16_t *const *k, uint16_t *const *v) {
    pd_kvt_page_info in;
    pd_kvt_bad bad = pd_kvt_page_check(page, len, fingerprint, g, &expect_hash, &in);
    if (bad) return bad;
    if (in.dtype != PD_KVT_BF16) return PD_KVT_BAD_FOREIGN;  // (the caller decodes it to floats instead)
    const uint8_t *p = (const uint8_t *)page + PD_KVT_HDR_BYTES;
    const pd_kvt_geom *gg = &in.geom;
    size_t row = (size_t)gg->n_kv_heads * (size_t)gg->head_dim, hb = (size_t)gg->head_dim * 2;
    for (int l = 0; l < gg->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int hh = 0; hh < gg->n_kv_heads; hh++) {
                uint16_t *dst = (kv ? v[l] : k[l]) + (size_t)hh * (size_t)gg->head_dim;
                p += 4;  // the scale: a bf16 page's values are not scaled (decode_head ignores it too)
                for (int t = 0; t < gg->block_size; t++, p += hb) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                    memcpy(dst + (size_t)t * row, p, hb);
#else
                    for (int i = 0; i < gg->head_dim; i++) dst[(size_t)t * row + (size_t)i] = (uint16_t)(p[2 * i] | (p[2 * i + 1] << 8));
#endif
                }
            }
    return PD_KVT_PAGE_OK;
}

pd_kvt_bad pd_kvt_page_decode(const void *page, size_t len, uint64_t fingerprint, const pd_kvt_geom *g,
                              pd_hash128 expect_hash, float *const *k, float *const *v) {
    pd_kvt_page_info in;
    pd_kvt_bad bad = pd_kvt_page_check(page, len, fingerprint, g, &expect_hash, &in);
    if (bad) return bad;
    const uint8_t *p = (const uint8_t *)page + PD_KVT_HDR_BYTES;
    const pd_kvt_geom *gg = &in.geom;
    size_t row = (size_t)gg->n_kv_heads * (size_t)gg->head_dim;
    size_t seg = 4 + (size_t)gg->block_size * (size_t)gg->head_dim * elem_bytes(in.dtype);
    int n_seg = gg->n_layers * 2 * gg->n_kv_heads;
    for (int s = 0; s < n_seg; s++) {
        int l = s / (2 * gg->n_kv_heads), kv = (s / gg->n_kv_heads) % 2, hh = s % gg->n_kv_heads;
        float *base = kv ? v[l] : k[l];
        decode_head(in.dtype, p + (size_t)s * seg, gg->block_size, gg->head_dim, row, base + (size_t)hh * gg->head_dim);
    }
    return PD_KVT_PAGE_OK;
}
