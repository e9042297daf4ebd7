// KV wire format: every message round-trips, and truncated, corrupted or lying frames are refused.
#include "test.h"
#include "wire/kv.h"

static pd_kvw_msg roundtrip(const pd_kvw_msg *in, pd_kvw_buf *b) {
    pd_kvw_buf_reset(b);
    PD_CHECK_EQ(pd_kvw_encode(b, in), PD_OK);
    pd_kvw_msg out;
    size_t used;
    pd_err err = {0};
    PD_CHECK_EQ(pd_kvw_decode(b->data, b->len, &out, &used, &err), PD_OK);
    PD_CHECK_EQ(used, b->len);
    // every strict prefix is incomplete, never an error or a partial message
    for (size_t n = 0; n < b->len; n += 7) {
        pd_kvw_msg t;
        size_t u;
        PD_CHECK_EQ(pd_kvw_decode(b->data, n, &t, &u, NULL), PD_AGAIN);
    }
    return out;
}

PD_TEST(kvw_roundtrip_all_types) {
    pd_kvw_buf b = {0};
    int32_t toks[5] = {1, 2, 3, 4, 5}, blks[1] = {9};
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_REQ};
    m.u.prefill_req = (pd_kvw_prefill_req){.req_id = 77, .start_pos = 0, .n_tokens = 5, .tokens = toks, .n_dst_blocks = 1,
                                           .dst_blocks = blks, .sampling = {.temperature = 0.5f, .top_k = 3, .seed = 42, .has_seed = 1}};
    snprintf(m.u.prefill_req.traceparent, sizeof m.u.prefill_req.traceparent,
             "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    pd_kvw_msg o = roundtrip(&m, &b);
    PD_CHECK_STR(o.u.prefill_req.traceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    PD_CHECK_EQ(o.type, PD_KVW_PREFILL_REQ);
    PD_CHECK_EQ(o.u.prefill_req.req_id, 77);
    PD_CHECK_EQ(o.u.prefill_req.tokens[4], 5);
    PD_CHECK_EQ(o.u.prefill_req.dst_blocks[0], 9);
    PD_CHECK_NEAR(o.u.prefill_req.sampling.temperature, 0.5, 0);
    PD_CHECK_EQ(o.u.prefill_req.sampling.seed, 42);
    pd_kvw_msg_fini(&o);

    m = (pd_kvw_msg){.type = PD_KVW_PREFILL_DONE};
    m.u.done.req_id = 5;
    m.u.done.first_token = 123;
    m.u.done.n_top = 2;
    m.u.done.top_ids[1] = 7;
    m.u.done.n_layers = 3;
    m.u.done.checksums[2] = 0xdeadbeefcafef00dull;
    m.u.done.queue_us = 1500;
    m.u.done.compute_us = 123456789012ll;
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.done.queue_us, 1500);
    PD_CHECK_EQ(o.u.done.compute_us, 123456789012ll);
    PD_CHECK_EQ(o.u.done.first_token, 123);
    PD_CHECK_EQ(o.u.done.top_ids[1], 7);
    PD_CHECK(o.u.done.checksums[2] == 0xdeadbeefcafef00dull);

    m = (pd_kvw_msg){.type = PD_KVW_HELLO};
    m.u.hello.fp.n_layers = 6;
    m.u.hello.transport = PD_KVW_TRANSPORT_SHM;
    m.u.hello.handle_len = 3;
    memcpy(m.u.hello.handle, "abc", 3);
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.hello.fp.n_layers, 6);
    PD_CHECK(!memcmp(o.u.hello.handle, "abc", 3));
    PD_CHECK_STR(pd_kvw_fingerprint_diff(&m.u.hello.fp, &o.u.hello.fp), "");
    o.u.hello.fp.weights_hash++;
    PD_CHECK_CONTAINS(pd_kvw_fingerprint_diff(&m.u.hello.fp, &o.u.hello.fp), "weights_hash");

    m = (pd_kvw_msg){.type = PD_KVW_PREFILL_FAIL};
    m.u.fail.req_id = 1;
    snprintf(m.u.fail.reason, sizeof m.u.fail.reason, "no room");
    o = roundtrip(&m, &b);
    PD_CHECK_STR(o.u.fail.reason, "no room");
    PD_CHECK_EQ(o.u.fail.code, PD_KVW_FAIL_ERROR);
    // v4: the code travels (a refused decode pool is told apart); an unknown code reads as an error
    m.u.fail.code = PD_KVW_FAIL_POOL_REFUSED;
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.fail.code, PD_KVW_FAIL_POOL_REFUSED);
    PD_CHECK_STR(o.u.fail.reason, "no room");
    m.u.fail.code = 77;
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.fail.code, PD_KVW_FAIL_ERROR);
    pd_kvw_buf_fini(&b);
}

PD_TEST(kvw_slab_payload_and_corruption) {
    pd_kvw_buf b = {0};
    uint8_t payload[64];
    for (int i = 0; i < 64; i++) payload[i] = (uint8_t)i;
    pd_kvw_msg m = {.type = PD_KVW_KV_SLAB};
    m.u.kv_slab = (pd_kvw_kv_slab){.req_id = 3, .layer = 2, .n_blocks = 1, .n_rows_last = 2, .row_bytes = 16, .payload_len = 64};
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    size_t hdr_body = b.len;  // the payload is not copied: it follows the frame on the wire
    uint8_t *all = pd_malloc(hdr_body + 64);
    memcpy(all, b.data, hdr_body);
    memcpy(all + hdr_body, payload, 64);
    PD_CHECK_EQ(pd_kvw_peek_len(all), hdr_body + 64);
    pd_kvw_msg o;
    size_t used;
    pd_err err = {0};
    PD_CHECK_EQ(pd_kvw_decode(all, hdr_body + 63, &o, &used, &err), PD_AGAIN);
    PD_CHECK_EQ(used, hdr_body + 64);
    PD_CHECK_EQ(pd_kvw_decode(all, hdr_body + 64, &o, &used, &err), PD_OK);
    PD_CHECK(o.u.kv_slab.payload == all + hdr_body);
    // a flipped body byte fails the body checksum; a bad magic or version is refused
    all[PD_KVW_HDR + 3] ^= 1;
    PD_CHECK_EQ(pd_kvw_decode(all, hdr_body + 64, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "body checksum mismatch");
    all[PD_KVW_HDR + 3] ^= 1;
    all[4] = 9;
    PD_CHECK_EQ(pd_kvw_decode(all, hdr_body + 64, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "unsupported version");
    all[0] = 0;
    PD_CHECK_EQ(pd_kvw_decode(all, hdr_body + 64, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "bad magic");
    pd_free(all);
    pd_kvw_buf_fini(&b);
}

// ucx: HELLO carries the UCX worker address + packed rkey (with cuda_ipc ~250-400 bytes): up to
// PD_KVW_HANDLE_MAX round-trips, a handle_len field one over it is refused, not truncated.
PD_TEST(kvw_ucx_hello_handle_max) {
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_HELLO};
    m.u.hello.transport = PD_KVW_TRANSPORT_UCX;
    m.u.hello.pool_n_blocks = 123;
    m.u.hello.handle_len = PD_KVW_HANDLE_MAX;
    for (int i = 0; i < PD_KVW_HANDLE_MAX; i++) m.u.hello.handle[i] = (uint8_t)(i * 13 + 5);
    pd_kvw_msg o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.hello.handle_len, PD_KVW_HANDLE_MAX);
    PD_CHECK(!memcmp(o.u.hello.handle, m.u.hello.handle, PD_KVW_HANDLE_MAX));
    // A sender claiming one byte more (the encoder writes the field as given, and the bytes it has):
    // the receiver refuses the frame instead of reading past the handle.
    m.u.hello.handle_len = PD_KVW_HANDLE_MAX + 1;
    pd_kvw_buf_reset(&b);
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    pd_err err = {0};
    size_t used;
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK(strstr(err.msg, "HELLO: handle too long") != NULL);
    pd_kvw_buf_fini(&b);
}

PD_TEST(kvw_nccl_hello_and_slab_roundtrip) {
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_HELLO};
    m.u.hello.transport = PD_KVW_TRANSPORT_NCCL;
    m.u.hello.pool_n_blocks = 4096;
    m.u.hello.handle_len = 128;  // an NCCL unique id
    for (int i = 0; i < 128; i++) m.u.hello.handle[i] = (uint8_t)(i * 7 + 1);
    pd_kvw_msg o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.u.hello.transport, PD_KVW_TRANSPORT_NCCL);
    PD_CHECK_EQ(o.u.hello.handle_len, 128);
    PD_CHECK(!memcmp(o.u.hello.handle, m.u.hello.handle, 128));
    PD_CHECK_STR(pd_kvw_transport_name(PD_KVW_TRANSPORT_NCCL), "nccl");

    // Llama-3-8B shape, 7500 tokens, layer 31 of 32: 2 x 469 blocks x 16 rows x 2048 bytes.
    m = (pd_kvw_msg){.type = PD_KVW_KV_NCCL};
    m.u.kv_nccl = (pd_kvw_kv_nccl){.req_id = 0x1122334455667788ull, .layer = 31, .n_layers = 32, .n_blocks = 469,
                                   .block_size = 16, .n_rows_last = 12, .row_bytes = 2048};
    m.u.kv_nccl.bytes = 2ull * 469 * 16 * 2048;
    PD_CHECK(m.u.kv_nccl.bytes == pd_kvw_kv_nccl_layer_bytes(469, 16, 2048));
    PD_CHECK(pd_kvw_kv_nccl_valid(&m.u.kv_nccl));
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(o.type, PD_KVW_KV_NCCL);
    PD_CHECK(o.u.kv_nccl.req_id == 0x1122334455667788ull);
    PD_CHECK_EQ(o.u.kv_nccl.layer, 31);
    PD_CHECK_EQ(o.u.kv_nccl.n_layers, 32);
    PD_CHECK_EQ(o.u.kv_nccl.n_blocks, 469);
    PD_CHECK_EQ(o.u.kv_nccl.block_size, 16);
    PD_CHECK_EQ(o.u.kv_nccl.n_rows_last, 12);
    PD_CHECK_EQ(o.u.kv_nccl.row_bytes, 2048);
    PD_CHECK(o.u.kv_nccl.bytes == 2ull * 469 * 16 * 2048);
    PD_CHECK_EQ(b.len, (size_t)PD_KVW_HDR + pd_kvw_max_body(PD_KVW_KV_NCCL));  // 44-byte body (v4)
    pd_kvw_buf_fini(&b);
}

// The one-layer slab layout both sides address: (K|V, block, row), so K starts at the base and V at
// stride = n_blocks * block_size * row_bytes, and the V region ends exactly at bytes. Every layer
// index of the request is valid; one past the last is not.
PD_TEST(kvw_nccl_slab_layers) {
    pd_kvw_kv_nccl s = {.layer = 0, .n_layers = 3, .n_blocks = 5, .block_size = 16, .n_rows_last = 7, .row_bytes = 64};
    s.bytes = 2ull * 5 * 16 * 64;
    for (int l = 0; l < 3; l++) {
        s.layer = l;
        PD_CHECK(pd_kvw_kv_nccl_valid(&s));
    }
    char *base = pd_malloc(s.bytes);
    PD_REQUIRE(base);
    void *k, *v;
    pd_kvw_kv_nccl_split(&s, base, &k, &v);
    size_t stride = 5 * 16 * 64;
    PD_CHECK((char *)k == base);
    PD_CHECK((char *)v - base == (ptrdiff_t)stride);
    PD_CHECK((char *)v - base + (ptrdiff_t)stride == (ptrdiff_t)s.bytes);
    pd_free(base);
    s.layer = 3;
    PD_CHECK(!pd_kvw_kv_nccl_valid(&s));
    s.layer = -1;
    PD_CHECK(!pd_kvw_kv_nccl_valid(&s));
}

// Re-encodes a KV_NCCL frame with one field changed; the decoder must refuse it.

static void nccl_refused(pd_kvw_kv_nccl s, const char *what) {
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_KV_NCCL};
    m.u.kv_nccl = s;
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    pd_kvw_msg o;
    size_t used;
    pd_err err = {0};
    if (pd_kvw_decode(b.data, b.len, &o, &used, &err) != PD_ERR_PROTO) PD_FAIL_("KV_NCCL with %s was accepted", what);
    else PD_CHECK_CONTAINS(err.msg, "KV_NCCL: bad geometry");
    pd_kvw_buf_fini(&b);
}

PD_TEST(kvw_nccl_bad_lengths_refused) {
    pd_kvw_kv_nccl ok = {.req_id = 1, .layer = 1, .n_layers = 2, .n_blocks = 3, .block_size = 16, .n_rows_last = 16,
                         .row_bytes = 64};
    ok.bytes = 2ull * 3 * 16 * 64;
    PD_CHECK(pd_kvw_kv_nccl_valid(&ok));
    pd_kvw_kv_nccl s = ok;
    s.bytes += 1;
    nccl_refused(s, "bytes one more than the slab");
    s = ok, s.bytes -= 64;
    nccl_refused(s, "bytes one row short");
    s = ok, s.n_rows_last = 17;
    nccl_refused(s, "n_rows_last > block_size");
    s = ok, s.n_rows_last = 0;
    nccl_refused(s, "n_rows_last 0");
    s = ok, s.n_blocks = -3, s.bytes = 0;
    nccl_refused(s, "negative n_blocks");
    s = ok, s.row_bytes = 60, s.bytes = 2ull * 3 * 16 * 60;
    nccl_refused(s, "row_bytes not a multiple of 8");
    s = ok, s.n_layers = PD_KVW_MAX_LAYERS + 1;
    nccl_refused(s, "too many layers");
    s = ok, s.layer = 2;
    nccl_refused(s, "a layer past the request's layers");
    s = ok, s.layer = -1;
    nccl_refused(s, "a negative layer");
    s = ok, s.bytes = 2ull * 2 * 3 * 16 * 64;
    nccl_refused(s, "a whole-request slab (version 3's size)");
    // a size that overflows 64 bits when multiplied out
    s = ok, s.n_layers = 512, s.n_blocks = 0x7fffffff, s.block_size = 4096, s.n_rows_last = 1, s.row_bytes = 1u << 20;
    s.layer = 0, s.bytes = (uint64_t)2 * 0x7fffffffull * 4096 * (1u << 20);  // wraps
    nccl_refused(s, "an overflowing size");

    // A truncated body (the frame says fewer bytes than the fields need) is refused, not read past.
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_KV_NCCL};
    m.u.kv_nccl = ok;
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    uint32_t body = (uint32_t)(b.len - PD_KVW_HDR) - 8;  // drop the last field (bytes)
    b.data[8] = (uint8_t)body, b.data[9] = (uint8_t)(body >> 8), b.data[10] = 0, b.data[11] = 0;
    pd_kvw_msg o;
    size_t used;
    pd_err err = {0};
    // (the body checksum would catch it first; the fuzzer's build skips that check and reaches this)
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len - 8, &o, &used, &err), PD_ERR_PROTO);
    // an old (version 1) peer is refused with a clear message
    m.u.kv_nccl = ok;
    pd_kvw_buf_reset(&b);
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    b.data[4] = 1;
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "unsupported version 1");
    pd_kvw_buf_fini(&b);
}

// Version 3: the auth frames round-trip with exact sizes, PREFILL_DONE carries n_draws, and every
// type's body is capped before it is read (peek_len refuses the header) — a lying header cannot
// make a receiver allocate more than the protocol allows.
PD_TEST(kvw_v3_auth_frames_and_caps) {
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_AUTH_PROOF};
    for (int i = 0; i < PD_KVW_NONCE; i++) m.u.auth.nonce[i] = (uint8_t)i;
    for (int i = 0; i < PD_KVW_MAC; i++) m.u.auth.mac[i] = (uint8_t)(200 - i);
    pd_kvw_msg o = roundtrip(&m, &b);
    PD_CHECK_EQ(b.len, PD_KVW_HDR + PD_KVW_NONCE + PD_KVW_MAC);
    PD_CHECK(!memcmp(o.u.auth.nonce, m.u.auth.nonce, PD_KVW_NONCE) && !memcmp(o.u.auth.mac, m.u.auth.mac, PD_KVW_MAC));
    m.type = PD_KVW_AUTH_CHALLENGE;
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(b.len, PD_KVW_HDR + PD_KVW_NONCE);
    PD_CHECK_EQ(pd_kvw_peek_type(b.data), PD_KVW_AUTH_CHALLENGE);
    m.type = PD_KVW_AUTH_OK;
    o = roundtrip(&m, &b);
    PD_CHECK_EQ(b.len, PD_KVW_HDR + PD_KVW_MAC);
    PD_CHECK(!memcmp(o.u.auth.mac, m.u.auth.mac, PD_KVW_MAC));

    m = (pd_kvw_msg){.type = PD_KVW_PREFILL_DONE};
    m.u.done.n_layers = PD_KVW_MAX_LAYERS;
    m.u.done.n_top = PD_KVW_MAX_TOP;
    m.u.done.n_draws = 0x123456789ull;
    o = roundtrip(&m, &b);
    PD_CHECK(o.u.done.n_draws == 0x123456789ull);
    PD_CHECK_EQ(b.len - PD_KVW_HDR, pd_kvw_max_body(PD_KVW_PREFILL_DONE));  // the largest DONE fits its cap exactly

    // Each type's largest legal body fits its cap; one byte more is refused at the header.
    pd_kvw_msg h = {.type = PD_KVW_HELLO};
    h.u.hello.handle_len = sizeof h.u.hello.handle;
    pd_kvw_buf_reset(&b);
    PD_CHECK_EQ(pd_kvw_encode(&b, &h), PD_OK);
    PD_CHECK(b.len - PD_KVW_HDR <= pd_kvw_max_body(PD_KVW_HELLO));
    PD_CHECK(pd_kvw_peek_len(b.data) == b.len);
    uint32_t over = pd_kvw_max_body(PD_KVW_HELLO) + 1;
    memcpy(b.data + 8, &over, 4);  // little-endian host
    PD_CHECK(pd_kvw_peek_len(b.data) == 0);
    pd_err err = {0};
    size_t used;
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &o, &used, &err), PD_ERR_PROTO);
    // a payload on anything but KV_SLAB is refused at the header
    m = (pd_kvw_msg){.type = PD_KVW_PING};
    pd_kvw_buf_reset(&b);
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    PD_CHECK(pd_kvw_peek_len(b.data) == b.len);
    b.data[16] = 1;
    PD_CHECK(pd_kvw_peek_len(b.data) == 0);
    // unknown types have no cap: refused
    PD_CHECK_EQ(pd_kvw_max_body((pd_kvw_type)99), 0);
    // a version-2 peer is refused
    b.data[16] = 0;
    b.data[4] = 2;
    PD_CHECK(pd_kvw_peek_len(b.data) == 0);
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "unsupported version 2");
    // and so is a version-3 peer (whole-request KV_NCCL slabs)
    b.data[4] = 3;
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &o, &used, &err), PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "unsupported version 3");
    pd_kvw_buf_fini(&b);
}
