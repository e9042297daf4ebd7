// hash.c — pd_hash_block: XXH3-128 over (parent hash || token ids), serialised little-endian so the
// value does not depend on the host's byte order (see hash.h for the exact definition).
//
// The bytes are staged through a small stack buffer and fed to a stack-allocated XXH3 streaming
// state, so hashing never allocates and any block size works.
#include "base/hash.h"

#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

pd_hash128 pd_hash_root(uint64_t extra_key) {
    pd_hash128 h = {extra_key, 0};
    return h;
}

static void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

pd_hash128 pd_hash_block(const pd_hash128 *parent, const int32_t *tokens, int n) {
    pd_hash128 root = pd_hash_root(0);
    if (!parent) parent = &root;
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset(&st);
    uint8_t buf[1024];
    put_le64(buf, parent->lo);
    put_le64(buf + 8, parent->hi);
    size_t used = 16;
    for (int i = 0; i < n; i++) {
        if (used + 4 > sizeof buf) {
            XXH3_128bits_update(&st, buf, used);
            used = 0;
        }
        put_le32(buf + used, (uint32_t)tokens[i]);
        used += 4;
    }
    XXH3_128bits_update(&st, buf, used);
    XXH128_hash_t d = XXH3_128bits_digest(&st);
    pd_hash128 h = {d.low64, d.high64};
    return h;
}
