// test_router_wire.c — the router ↔ worker control messages (wire/control.h): encode → decode
// round-trips, strictness on malformed input, versioning, hex hashes, and the worker's event log.
#include <jansson.h>

#include "test.h"
#include "wire/control.h"

static char *dump(json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

PD_TEST(hash_hex_roundtrip) {
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    for (int i = 0; i < 100; i++) {
        pd_hash128 h = {pd_rng_next(&rng), pd_rng_next(&rng)}, back;
        char hex[PD_WIRE_HASH_HEX_LEN + 1];
        pd_wire_hash_to_hex(h, hex);
        PD_CHECK_EQ(strlen(hex), 32);
        PD_CHECK_EQ(pd_wire_hash_from_hex(hex, &back), PD_OK);
        PD_CHECK(pd_hash128_eq(h, back));
    }
    pd_hash128 h = {0x0123456789abcdefull, 0xfedcba9876543210ull};
    char hex[33];
    pd_wire_hash_to_hex(h, hex);
    PD_CHECK_STR(hex, "fedcba98765432100123456789abcdef");  // hi then lo
    pd_hash128 x;
    PD_CHECK_EQ(pd_wire_hash_from_hex("abc", &x), PD_ERR_PROTO);
    PD_CHECK_EQ(pd_wire_hash_from_hex("zedcba98765432100123456789abcdef", &x), PD_ERR_PROTO);
    PD_CHECK_EQ(pd_wire_hash_from_hex("fedcba98765432100123456789abcdef0", &x), PD_ERR_PROTO);
    PD_CHECK_EQ(pd_wire_hash_from_hex(NULL, &x), PD_ERR_PROTO);
}

PD_TEST(register_roundtrip_and_errors) {
    pd_wire_register m = {.role = PD_WIRE_ROLE_DECODE, .block_size = 32};
    snprintf(m.url, sizeof m.url, "http://127.0.0.1:9001");
    snprintf(m.model, sizeof m.model, "kjv");
    char *s = dump(pd_wire_register_to_json(&m));
    PD_REQUIRE(s);
    pd_wire_register d;
    pd_err err = {0};
    PD_CHECK_EQ(pd_wire_register_decode(s, strlen(s), &d, &err), PD_OK);
    free(s);
    PD_CHECK_STR(d.url, "http://127.0.0.1:9001");
    PD_CHECK_STR(d.model, "kjv");
    PD_CHECK_EQ(d.role, PD_WIRE_ROLE_DECODE);
    PD_CHECK_EQ(d.block_size, 32);
    // trailing slashes are dropped; role defaults to both
    const char *ok = "{\"v\":1,\"url\":\"http://h:1/\"}";
    PD_CHECK_EQ(pd_wire_register_decode(ok, strlen(ok), &d, &err), PD_OK);
    PD_CHECK_STR(d.url, "http://h:1");
    PD_CHECK_EQ(d.role, PD_WIRE_ROLE_BOTH);
    const char *bad[] = {
        "", "[]", "{\"url\":\"http://h:1\"}",                          // no version
        "{\"v\":1}", "{\"v\":1,\"url\":7}", "{\"v\":1,\"url\":\"ftp://h\"}",
        "{\"v\":1,\"url\":\"http://h:1\",\"role\":\"boss\"}",
        "{\"v\":1,\"url\":\"http://h:1\",\"block_size\":0}",
        "{\"v\":1,\"type\":\"state\",\"url\":\"http://h:1\"}",
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++)
        PD_CHECK_MSG(pd_wire_register_decode(bad[i], strlen(bad[i]), &d, &err) == PD_ERR_PROTO, "accepted %s", bad[i]);
    const char *newer = "{\"v\":2,\"url\":\"http://h:1\"}";
    PD_CHECK_EQ(pd_wire_register_decode(newer, strlen(newer), &d, &err), PD_ERR_UNSUPPORTED);

    s = dump(pd_wire_deregister_to_json("http://h:2"));
    char url[PD_WIRE_URL_MAX];
    PD_CHECK_EQ(pd_wire_deregister_decode(s, strlen(s), url, &err), PD_OK);
    PD_CHECK_STR(url, "http://h:2");
    free(s);
    PD_CHECK_EQ(pd_wire_deregister_decode("{\"v\":1}", 7, url, &err), PD_ERR_PROTO);
}

PD_TEST(state_roundtrip) {
    pd_wire_kv_event ev[3] = {
        {.seq = 5, .type = PD_WIRE_KV_STORED, .n_tokens = 16, .hash = {1, 2}, .parent_hash = {3, 4}},
        {.seq = 6, .type = PD_WIRE_KV_REMOVED, .hash = {~0ull, 0x8000000000000000ull}},
        {.seq = 7, .type = PD_WIRE_KV_ALL_CLEARED},
    };
    pd_wire_state s = {.instance = 0xdeadbeefcafef00dull, .role = PD_WIRE_ROLE_PREFILL, .block_size = 16,
                       .is_reset = true, .seq_next = 8, .events = ev, .n_events = 3};
    snprintf(s.model, sizeof s.model, "m");
    s.load = pd_wire_load_default();
    s.load.n_running = 3;
    s.load.n_waiting = 4;
    s.load.n_waiting_prefill_tokens = 1234567890123ll;
    s.load.n_kv_blocks_total = 100;
    s.load.n_kv_blocks_free = 60;
    s.load.n_kv_blocks_used = 40;
    s.load.n_kv_blocks_cached = 10;
    s.load.prefill_tokens_per_s = 1500.5;
    s.load.decode_step_ms = 7.25;
    s.load.n_prefix_query_tokens = 1000;
    s.load.n_prefix_hit_tokens = 640;
    s.load.n_requests_finished = 9;
    s.load.n_max_seqs = 64;
    s.load.n_max_waiting = 4096;
    s.load.n_kv_handoffs = 11;
    s.load.n_kv_handoff_bytes = 5000000000ll;
    s.load.kv_handoff_us = 777;
    s.load.n_kv_fallbacks[2] = 3;  // worker_died
    s.load.n_kv_local_short = 5;
    s.load.n_kv_exports = 6;
    s.load.n_kv_export_bytes = 42;
    s.load.n_ttft = 12;
    s.load.ttft_ms_sum[0] = 1.5, s.load.ttft_ms_sum[3] = 9.25;
    char *txt = NULL;
    size_t len = 0;
    PD_REQUIRE(pd_wire_state_encode(&s, &txt, &len) == PD_OK);
    PD_CHECK_CONTAINS(txt, "\"v\":1");
    PD_CHECK_CONTAINS(txt, "\"type\":\"state\"");
    PD_CHECK_CONTAINS(txt, "\"instance\":\"deadbeefcafef00d\"");
    pd_wire_state d;
    pd_err err = {0};
    PD_CHECK_EQ(pd_wire_state_decode(txt, len, &d, &err), PD_OK);
    pd_free(txt);
    PD_CHECK(d.instance == s.instance);
    PD_CHECK_STR(d.model, "m");
    PD_CHECK_EQ(d.role, PD_WIRE_ROLE_PREFILL);
    PD_CHECK_EQ(d.block_size, 16);
    PD_CHECK(d.is_reset);
    PD_CHECK_EQ(d.seq_next, 8);
    PD_CHECK_EQ(d.load.n_running, 3);
    PD_CHECK_EQ(d.load.n_waiting, 4);
    PD_CHECK_EQ(d.load.n_waiting_prefill_tokens, 1234567890123ll);
    PD_CHECK_EQ(d.load.n_kv_blocks_total, 100);
    PD_CHECK_EQ(d.load.n_kv_blocks_free, 60);
    PD_CHECK_EQ(d.load.n_kv_blocks_used, 40);
    PD_CHECK_EQ(d.load.n_kv_blocks_cached, 10);
    PD_CHECK_NEAR(d.load.prefill_tokens_per_s, 1500.5, 1e-9);
    PD_CHECK_NEAR(d.load.decode_step_ms, 7.25, 1e-9);
    PD_CHECK_EQ(d.load.n_prefix_query_tokens, 1000);
    PD_CHECK_EQ(d.load.n_prefix_hit_tokens, 640);
    PD_CHECK_EQ(d.load.n_requests_finished, 9);
    PD_CHECK_EQ(d.load.n_max_seqs, 64);
    PD_CHECK_EQ(d.load.n_max_waiting, 4096);
    PD_CHECK_EQ(d.load.n_kv_handoffs, 11);
    PD_CHECK_EQ(d.load.n_kv_handoff_bytes, 5000000000ll);
    PD_CHECK_EQ(d.load.kv_handoff_us, 777);
    PD_CHECK_EQ(d.load.n_kv_fallbacks[2], 3);
    PD_CHECK_EQ(d.load.n_kv_fallbacks[0], 0);
    PD_CHECK_EQ(d.load.n_kv_local_short, 5);
    PD_CHECK_EQ(d.load.n_kv_exports, 6);
    PD_CHECK_EQ(d.load.n_kv_export_bytes, 42);
    PD_CHECK_EQ(d.load.n_ttft, 12);
    PD_CHECK_NEAR(d.load.ttft_ms_sum[0], 1.5, 1e-9);
    PD_CHECK_NEAR(d.load.ttft_ms_sum[3], 9.25, 1e-9);
    PD_REQUIRE(d.n_events == 3);
    for (int i = 0; i < 3; i++) {
        PD_CHECK_EQ(d.events[i].seq, ev[i].seq);
        PD_CHECK_EQ(d.events[i].type, ev[i].type);
    }
    PD_CHECK_EQ(d.events[0].n_tokens, 16);
    PD_CHECK(pd_hash128_eq(d.events[0].hash, ev[0].hash));
    PD_CHECK(pd_hash128_eq(d.events[0].parent_hash, ev[0].parent_hash));
    PD_CHECK(pd_hash128_eq(d.events[1].hash, ev[1].hash));
    pd_wire_state_fini(&d);
    pd_wire_state_fini(&d);  // idempotent
}

PD_TEST(state_load_capacity_absent_or_bad) {
    // An older worker reports no capacity (0 = unknown: the router refuses nothing on it); negative
    // values from a broken one read as unknown too.
    const char *old = "{\"v\":1,\"type\":\"state\",\"instance\":\"00000000000000aa\",\"role\":\"both\","
                      "\"block_size\":16,\"load\":{\"running\":1},\"events\":{\"reset\":false,\"seq_next\":0,\"list\":[]}}";
    pd_wire_state d;
    pd_err err = {0};
    PD_REQUIRE(pd_wire_state_decode(old, strlen(old), &d, &err) == PD_OK);
    PD_CHECK_EQ(d.load.n_max_seqs, 0);
    PD_CHECK_EQ(d.load.n_max_waiting, 0);
    PD_CHECK_EQ(d.load.n_ttft, 0);
    pd_wire_state_fini(&d);
    const char *bad = "{\"v\":1,\"type\":\"state\",\"instance\":\"00000000000000aa\",\"role\":\"both\","
                      "\"block_size\":16,\"load\":{\"max_seqs\":-5,\"max_waiting\":-1},"
                      "\"events\":{\"reset\":false,\"seq_next\":0,\"list\":[]}}";
    PD_REQUIRE(pd_wire_state_decode(bad, strlen(bad), &d, &err) == PD_OK);
    PD_CHECK_EQ(d.load.n_max_seqs, 0);
    PD_CHECK_EQ(d.load.n_max_waiting, 0);
    pd_wire_state_fini(&d);
}

PD_TEST(state_lenient_and_strict) {
    pd_wire_state d;
    pd_err err = {0};
    // minimal: missing load fields read as 0 / unknown rates; unknown fields and event types ignored
    const char *min = "{\"v\":1,\"type\":\"state\",\"future\":[1,2],"
                      "\"events\":{\"seq_next\":3,\"list\":[{\"seq\":2,\"type\":\"evicted_all_v2\"}]}}";
    PD_CHECK_EQ(pd_wire_state_decode(min, strlen(min), &d, &err), PD_OK);
    PD_CHECK_EQ(d.load.n_running, 0);
    PD_CHECK(d.load.prefill_tokens_per_s < 0);
    PD_CHECK(d.load.decode_step_ms < 0);
    PD_CHECK_EQ(d.n_events, 1);
    if (d.n_events == 1) PD_CHECK_EQ(d.events[0].type, PD_WIRE_KV_ALL_CLEARED);  // unknown → forget
    PD_CHECK_EQ(d.seq_next, 3);
    pd_wire_state_fini(&d);
    const char *bad[] = {
        "{\"v\":1,\"type\":\"register\"}",
        "{\"type\":\"state\"}",
        "{\"v\":1,\"type\":\"state\",\"events\":{\"list\":[{\"type\":\"stored\",\"hash\":\"00\",\"parent\":\"00\"}]}}",
        "{\"v\":1,\"type\":\"state\",\"events\":{\"list\":[7]}}",
        "{\"v\":1,\"type\":\"state\",\"events\":{\"list\":[{\"type\":\"removed\"}]}}",
        "{\"v\":1,\"type\":\"state\"",
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        PD_CHECK_MSG(pd_wire_state_decode(bad[i], strlen(bad[i]), &d, &err) == PD_ERR_PROTO, "accepted %s", bad[i]);
        pd_wire_state_fini(&d);
    }
    const char *newer = "{\"v\":9,\"type\":\"state\"}";
    PD_CHECK_EQ(pd_wire_state_decode(newer, strlen(newer), &d, &err), PD_ERR_UNSUPPORTED);
    pd_wire_state_fini(&d);
}

PD_TEST(kv_log_since_and_reset) {
    pd_wire_kv_log *l = pd_wire_kv_log_new(4);
    PD_REQUIRE(l);
    PD_CHECK(pd_wire_kv_log_new(0) == NULL);
    pd_hash128 h = {1, 1}, p = {0, 0};
    for (int i = 0; i < 3; i++) PD_CHECK_EQ(pd_wire_kv_log_push(l, PD_WIRE_KV_STORED, h, p, 16), i);
    pd_wire_state s;
    memset(&s, 0, sizeof s);
    PD_CHECK_EQ(pd_wire_kv_log_read(l, 0, 100, &s), PD_OK);
    PD_CHECK(!s.is_reset);
    PD_CHECK_EQ(s.n_events, 3);
    PD_CHECK_EQ(s.seq_next, 3);
    PD_CHECK_EQ(pd_wire_kv_log_read(l, 1, 1, &s), PD_OK);  // n_max caps, seq_next continues
    PD_CHECK_EQ(s.n_events, 1);
    PD_CHECK_EQ(s.events[0].seq, 1);
    PD_CHECK_EQ(s.seq_next, 2);
    PD_CHECK_EQ(pd_wire_kv_log_read(l, 3, 100, &s), PD_OK);  // up to date
    PD_CHECK_EQ(s.n_events, 0);
    PD_CHECK(!s.is_reset);
    for (int i = 0; i < 4; i++) pd_wire_kv_log_push(l, PD_WIRE_KV_REMOVED, h, p, 0);  // seqs 3..6; 0..2 lost
    PD_CHECK_EQ(pd_wire_kv_log_seq_next(l), 7);
    PD_CHECK_EQ(pd_wire_kv_log_read(l, 1, 100, &s), PD_OK);  // fell behind the ring
    PD_CHECK(s.is_reset);
    PD_CHECK_EQ(s.n_events, 4);
    PD_CHECK_EQ(s.events[0].seq, 3);
    PD_CHECK_EQ(s.seq_next, 7);
    PD_CHECK_EQ(pd_wire_kv_log_read(l, 99, 100, &s), PD_OK);  // a poller from a previous life
    PD_CHECK(s.is_reset);
    PD_CHECK_EQ(s.n_events, 4);
    pd_wire_state_fini(&s);
    pd_wire_kv_log_free(l);
    pd_wire_kv_log_free(NULL);
}

PD_TEST(token_ids_decode) {
    int32_t *ids = NULL, n = 0;
    const char *ok = "{\"token_ids\":[1,2,32000]}";
    PD_CHECK_EQ(pd_wire_token_ids_decode(ok, strlen(ok), &ids, &n, NULL), PD_OK);
    PD_CHECK_EQ(n, 3);
    if (n == 3) PD_CHECK_EQ(ids[2], 32000);
    pd_free(ids);
    const char *bad[] = {"{}", "{\"token_ids\":[1,-1]}", "{\"token_ids\":[\"a\"]}", "nope"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        PD_CHECK(pd_wire_token_ids_decode(bad[i], strlen(bad[i]), &ids, &n, NULL) == PD_ERR_PROTO);
        PD_CHECK(ids == NULL);
    }
}

// KV events of blocks in a tier below the device pool carry "tier"; the load reports the tiers.
PD_TEST(state_tiers_roundtrip) {
    pd_wire_kv_event ev[3] = {
        {.seq = 1, .type = PD_WIRE_KV_STORED, .tier = PD_WIRE_TIER_DISK, .n_tokens = 16, .hash = {1, 2}, .parent_hash = {3, 4}},
        {.seq = 2, .type = PD_WIRE_KV_REMOVED, .tier = PD_WIRE_TIER_DRAM, .hash = {5, 6}},
        {.seq = 3, .type = PD_WIRE_KV_STORED, .n_tokens = 16, .hash = {7, 8}, .parent_hash = {1, 2}},
    };
    pd_wire_state s = {.role = PD_WIRE_ROLE_BOTH, .block_size = 16, .seq_next = 4, .events = ev, .n_events = 3};
    s.load = pd_wire_load_default();
    s.load.n_tiers = 2;
    snprintf(s.load.tier_names[0], 8, "dram");
    snprintf(s.load.tier_names[1], 8, "redis");
    s.load.tier_hits[1] = 77;
    s.load.tier_misses[0] = 5;
    s.load.n_tier_hit_tokens = 1600;
    s.load.tier_load_us = 12345;
    char *txt = NULL;
    size_t len = 0;
    PD_REQUIRE(pd_wire_state_encode(&s, &txt, &len) == PD_OK);
    PD_CHECK_CONTAINS(txt, "\"tier\":\"disk\"");
    pd_wire_state d;
    pd_err err = {0};
    PD_CHECK_EQ(pd_wire_state_decode(txt, len, &d, &err), PD_OK);
    pd_free(txt);
    PD_REQUIRE(d.n_events == 3);
    PD_CHECK_EQ(d.events[0].tier, PD_WIRE_TIER_DISK);
    PD_CHECK_EQ(d.events[1].tier, PD_WIRE_TIER_DRAM);
    PD_CHECK_EQ(d.events[2].tier, PD_WIRE_TIER_DEVICE);
    PD_CHECK_EQ(d.load.n_tiers, 2);
    PD_CHECK_STR(d.load.tier_names[1], "redis");
    PD_CHECK_EQ(d.load.tier_hits[1], 77);
    PD_CHECK_EQ(d.load.tier_misses[0], 5);
    PD_CHECK_EQ(d.load.n_tier_hit_tokens, 1600);
    PD_CHECK_EQ(d.load.tier_load_us, 12345);
    pd_wire_state_fini(&d);
    // A tier name from the future is no known tier (the router skips the event: never a wrong bit).
    PD_CHECK_EQ(pd_wire_tier_parse("nvme-of"), PD_WIRE_N_TIERS);
    PD_CHECK_EQ(pd_wire_tier_parse(NULL), PD_WIRE_TIER_DEVICE);
}
