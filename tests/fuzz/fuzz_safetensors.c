// libFuzzer target: the safetensors header parser on arbitrary bytes (the whole input is treated
// as a file: 8-byte length, JSON header, data). Every accepted tensor must lie inside the input.
#include <stdint.h>
#include <stdlib.h>

#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_st *st = pd_st_new_empty();
    if (!st) return 0;
    pd_err err = {0};
    if (pd_st_parse(st, data, size, 0, "fuzz", &err) == PD_OK) {
        for (int i = 0; i < pd_st_n_tensors(st); i++) {
            const pd_st_tensor *t = pd_st_get(st, i);
            const uint8_t *p = t->data;
            if (p < data || p + t->n_bytes > data + size) abort();
            if (t->n_bytes > 0) {
                volatile uint8_t x = p[0] ^ p[t->n_bytes - 1];  // touch both ends under ASan
                (void)x;
            }
            if (t->dtype != PD_ST_OTHER && t->n_bytes < (1u << 20)) {
                float *f = malloc(sizeof(float) * (size_t)pd_st_numel(t) + 1);
                if (f) pd_st_to_f32(t, f);
                free(f);
            }
        }
    }
    pd_st_free(st);
    return 0;
}
