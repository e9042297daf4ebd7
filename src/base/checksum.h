// checksum — the KV-transfer checksum. Both ends of a KV handoff compute it over the bytes of a
// slab (one layer's K and V rows of the transferred token span), the sender over its source
// blocks and the receiver over what landed in its own blocks, so a corrupted, truncated or
// misplaced transfer is detected and never decoded from.
//
// Definition (stable; crosses processes and is computed on CPUs and GPUs alike):
//   a slab is a sequence of byte runs r_0, r_1, ... (each a multiple of 8 bytes); let w_g be the
//   g-th little-endian 64-bit word over the concatenation of all runs. Then
//       sum = Σ_g mix64(w_g + g * 0x9E3779B97F4A7C15)   (mod 2^64)
//   with mix64 the splitmix64 finaliser. A sum of per-word mixes is order-independent in how it is
//   *computed* (so GPU threads can reduce in any order) but position-sensitive through g.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

static inline uint64_t pd_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Adds the words of one run (n_bytes a multiple of 8) starting at global word index *g to *sum,
// and advances *g. Call it for each run in order.
void pd_checksum_run(uint64_t *sum, uint64_t *g, const void *data, size_t n_bytes);

#ifdef __cplusplus
}
#endif
