// libFuzzer target: the KV wire-format decoder (version 3) on arbitrary bytes. Decodes frames back
// to back as a stream reader would; every accepted message must point only inside the input, fit
// its type's body cap (what a receiver allocates before decoding), agree with pd_kvw_peek_len
// (what the receiver reads), and every accepted KV_NCCL announcement must describe a consistent slab.
#include <stdint.h>
#include <stdlib.h>

#include "wire/kv.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t off = 0;
    while (off < size) {
        pd_kvw_msg m;
        size_t used = 0;
        pd_status st = pd_kvw_decode(data + off, size - off, &m, &used, NULL);
        if (st != PD_OK) break;
        uint32_t body_len = (uint32_t)data[off + 8] | (uint32_t)data[off + 9] << 8 | (uint32_t)data[off + 10] << 16 |
                            (uint32_t)data[off + 11] << 24;
        if (body_len > pd_kvw_max_body(m.type) || pd_kvw_peek_len(data + off) != used || pd_kvw_peek_type(data + off) != m.type)
            abort();
        if (m.type == PD_KVW_KV_SLAB && m.u.kv_slab.payload_len &&
            (m.u.kv_slab.payload < data || m.u.kv_slab.payload + m.u.kv_slab.payload_len > data + size))
            abort();
        // an accepted slab announcement has a consistent geometry (the receiver sizes its recv by it)
        if (m.type == PD_KVW_KV_NCCL && !pd_kvw_kv_nccl_valid(&m.u.kv_nccl)) abort();
        if (m.type == PD_KVW_PREFILL_REQ) {
            volatile int32_t x = m.u.prefill_req.tokens[m.u.prefill_req.n_tokens - 1];
            if (m.u.prefill_req.n_dst_blocks) x ^= m.u.prefill_req.dst_blocks[m.u.prefill_req.n_dst_blocks - 1];
            (void)x;
        }
        pd_kvw_msg_fini(&m);
        if (used == 0) abort();
        off += used;
    }
    return 0;
}
