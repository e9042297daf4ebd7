// hash — the prefix-cache block hash, shared by kv/ (which caches blocks by it) and router/ (which
// predicts which worker holds a prompt's prefix from the hashes workers publish). It lives in base/
// because the router may not include kv/; both sides must compute bit-identical values.
//
// Definition (stable: it crosses process boundaries, never change it without a wire version bump):
//
//   h_0 = XXH3_128( le128(root)  || le32(t_0) || ... || le32(t_{B-1}) )          first block
//   h_i = XXH3_128( le128(h_{i-1}) || le32(tokens of block i) )                    later blocks
//
//   where le128(h) is h.lo then h.hi, each 8 bytes little-endian, le32 is a token id as 4 bytes
//   little-endian, and root = pd_hash_root(extra_key) (extra_key 0 = {0, 0}: the plain model).
//
// The extra key separates caches that must never share KV for equal tokens (a LoRA adapter id, a
// cache salt). pd_hash_root is injective in the key, so a consumer can compare roots exactly.
//
// A 128-bit hash makes accidental collisions negligible, but kv/ never relies on that: a hit is
// only accepted after comparing the stored tokens and the parent block (see kv/prefix.c).
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_hash128 {
    uint64_t lo, hi;
} pd_hash128;

// The chain root for an extra key: {extra_key, 0}. Deterministic and injective.
pd_hash128 pd_hash_root(uint64_t extra_key);

// h = H(parent || tokens[0..n)). parent NULL means pd_hash_root(0). n >= 0; tokens may be NULL
// when n == 0. Pure function, thread-safe.
pd_hash128 pd_hash_block(const pd_hash128 *parent, const int32_t *tokens, int n);

static inline bool pd_hash128_eq(pd_hash128 a, pd_hash128 b) {
    return a.lo == b.lo && a.hi == b.hi;
}

#ifdef __cplusplus
}
#endif
