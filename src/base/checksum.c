// checksum.c — see checksum.h.
#include "base/checksum.h"

#include <string.h>

void pd_checksum_run(uint64_t *sum, uint64_t *g, const void *data, size_t n_bytes) {
    const unsigned char *p = data;
    uint64_t s = *sum, idx = *g;
    for (size_t i = 0; i + 8 <= n_bytes; i += 8, idx++) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        s += pd_mix64(w + idx * 0x9E3779B97F4A7C15ull);
    }
    *sum = s;
    *g = idx;
}
