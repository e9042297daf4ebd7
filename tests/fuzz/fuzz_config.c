// libFuzzer target: config.json parsing (and the derived RoPE frequencies and sizes) on
// arbitrary bytes.
#include <stdint.h>

#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_model_config c;
    pd_err err = {0};
    if (pd_model_config_parse((const char *)data, size, &c, &err) == PD_OK) {
        float f[512];
        if (c.head_dim / 2 <= 512) pd_model_config_inv_freq(&c, f);
        (void)pd_model_config_n_params(&c);
        (void)pd_model_config_kv_bytes_per_token(&c, 2);
    }
    return 0;
}
