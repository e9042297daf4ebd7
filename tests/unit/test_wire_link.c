// test_wire_link.c — the link-aware disaggregation model (wire/link.h): the exponentially weighted
// fit, the local / remote predictions and the flip point against hand-computed values, unknown
// numbers, and the JSON round trip the router relies on.
#include <jansson.h>
#include <math.h>

#include "test.h"
#include "wire/link.h"

static pd_disagg_model model(void) {
    pd_disagg_model m;
    memset(&m, 0, sizeof m);
    m.local_a_us = 2000;   // 2 ms per step
    m.local_b_us = 100;    // 0.1 ms per token
    m.chunk_tokens = 16;
    m.bytes_per_token = 6144;
    m.min_tokens = 16;
    m.n_links = 2;
    pd_link_stats fast = {.is_healthy = true, .rtt_us = 200, .bw_bytes_per_s = 1.25e9, .remote_a_us = 2000,
                          .remote_b_us = 100, .remote_chunk = 0, .queue_us = 0, .xfer_factor = -1};
    pd_link_stats slow = fast;
    slow.bw_bytes_per_s = 12.5e6;  // 100 Mbit/s
    snprintf(fast.peer, sizeof fast.peer, "p1:1");
    snprintf(slow.peer, sizeof slow.peer, "p2:1");
    m.links[0] = fast;
    m.links[1] = slow;
    return m;
}

PD_TEST(fit_recovers_a_line_and_refuses_one_sample) {
    pd_link_fit f = {0};
    double a = -1, b = -1;
    pd_link_fit_add(&f, 8, 2000 + 8 * 100, 0.1);
    PD_CHECK(!pd_link_fit_get(&f, &a, &b));  // one sample
    pd_link_fit_add(&f, 8, 2000 + 8 * 100, 0.1);
    PD_CHECK(pd_link_fit_get(&f, &a, &b));  // one x value: proportional, exact there
    PD_CHECK(a == 0 && fabs(b * 8 - 2800) < 1e-6);
    for (int i = 0; i < 50; i++) pd_link_fit_add(&f, 1 + i % 9, 2000 + (1 + i % 9) * 100, 0.1);
    PD_CHECK(pd_link_fit_get(&f, &a, &b));
    PD_CHECK(fabs(a - 2000) < 1e-6 && fabs(b - 100) < 1e-6);
    pd_link_fit g = {0};  // falling times are noise: never a negative slope
    pd_link_fit_add(&g, 1, 500, 0.1);
    pd_link_fit_add(&g, 10, 100, 0.1);
    PD_CHECK(pd_link_fit_get(&g, &a, &b) && b == 0 && a > 0);
}

PD_TEST(predictions_match_the_formulas) {
    pd_disagg_model m = model();
    // local(100) = ceil(100/16) = 7 steps × 2000 + 100 × 100
    PD_CHECK(fabs(pd_disagg_local_us(&m, 100) - (7 * 2000 + 100 * 100)) < 1e-6);
    // remote over the fast link: 2000 + 100×100 + 200 + 100×6144/1.25e9 s
    double want = 2000 + 100 * 100 + 200 + 100 * 6144 / 1.25e9 * 1e6;
    PD_CHECK(fabs(pd_disagg_remote_us(&m, 0, 100) - want) < 1e-6);
    m.links[0].xfer_factor = 0.5;  // half the link time hidden behind compute
    PD_CHECK(fabs(pd_disagg_remote_us(&m, 0, 100) - (want - 0.5 * 100 * 6144 / 1.25e9 * 1e6)) < 1e-6);
    m.links[0].xfer_factor = -1;
    double us;
    PD_CHECK_EQ(pd_disagg_best_link(&m, 100, &us), 0);
    // The fast link flips where 2000×ceil(n/16) + 100n > 2200 + n(100 + 4.9152): the first n with
    // a second local step that the transfer does not eat: n = 17 (4000 + 1700 > 2200 + 1783.6).
    PD_CHECK_EQ(pd_disagg_flip_tokens(&m, 0, 2048), 17);
    // 100 Mbit/s: 491.5 µs per token of transfer against 125 µs of chunked local prefill: never.
    PD_CHECK_EQ(pd_disagg_flip_tokens(&m, 1, 2048), -1);
    bool remote = false;
    pd_disagg_predict_us(&m, 8, &remote);
    PD_CHECK(!remote);  // under min_tokens
    pd_disagg_predict_us(&m, 500, &remote);
    PD_CHECK(remote);
    m.links[0].is_healthy = false;  // only the slow link left: local
    pd_disagg_predict_us(&m, 500, &remote);
    PD_CHECK(!remote);
}

PD_TEST(unknown_numbers_make_predictions_unknown) {
    pd_disagg_model m = model();
    m.links[0].bw_bytes_per_s = -1;
    PD_CHECK(pd_disagg_remote_us(&m, 0, 100) < 0);
    m.links[0] = model().links[0];
    m.links[0].remote_a_us = m.links[0].remote_b_us = -1;  // falls back to the local model
    PD_CHECK(pd_disagg_remote_us(&m, 0, 100) > 0);
    m.local_a_us = -1;
    PD_CHECK(pd_disagg_local_us(&m, 100) < 0);
    PD_CHECK(pd_disagg_remote_us(&m, 0, 100) < 0);
    PD_CHECK_EQ(pd_disagg_flip_tokens(&m, 0, 100), -1);
    PD_CHECK(pd_disagg_remote_us(&m, 5, 100) < 0);  // no such link
}

PD_TEST(json_round_trip) {
    pd_disagg_model m = model(), back;
    m.links[1].xfer_factor = 0.75;
    m.links[1].remote_chunk = 2048;
    json_t *o = pd_disagg_model_to_json(&m, 2048);
    PD_CHECK(o != NULL);
    PD_CHECK_EQ(json_integer_value(json_object_get(json_array_get(json_object_get(o, "links"), 0), "flip_tokens")), 17);
    PD_CHECK_EQ(pd_disagg_model_from_json(o, &back), PD_OK);
    json_decref(o);
    PD_CHECK_EQ(back.n_links, 2);
    PD_CHECK(back.local_a_us == m.local_a_us && back.chunk_tokens == 16 && back.min_tokens == 16);
    PD_CHECK(!strcmp(back.links[1].peer, "p2:1") && back.links[1].xfer_factor == 0.75 && back.links[1].remote_chunk == 2048);
    PD_CHECK(fabs(pd_disagg_remote_us(&back, 1, 300) - pd_disagg_remote_us(&m, 1, 300)) < 1e-6);
    json_t *bad = json_pack("{s:s}", "links", "nope");
    PD_CHECK_EQ(pd_disagg_model_from_json(bad, &back), PD_ERR_PROTO);
    json_decref(bad);
}

#include "wire/kv.h"

PD_TEST(probe_frames_round_trip_and_are_bounded) {
    pd_kvw_buf b = {0};
    pd_kvw_msg m = {.type = PD_KVW_PROBE_DATA}, d;
    m.u.probe.nonce = 42;
    m.u.probe.bytes = 4096;
    m.u.probe.step_a_us = 1500.5f;
    m.u.probe.step_b_us = 90.25f;
    m.u.probe.chunk_tokens = 2048;
    PD_CHECK_EQ(pd_kvw_encode(&b, &m), PD_OK);
    size_t used = 0;
    pd_err err = {0};
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &d, &used, &err), PD_OK);
    PD_CHECK_EQ(used, b.len);
    PD_CHECK(d.type == PD_KVW_PROBE_DATA && d.u.probe.nonce == 42 && d.u.probe.bytes == 4096);
    PD_CHECK(d.u.probe.step_a_us == 1500.5f && d.u.probe.step_b_us == 90.25f && d.u.probe.chunk_tokens == 2048);
    pd_kvw_msg_fini(&d);
    pd_kvw_buf_reset(&b);
    pd_kvw_msg q = {.type = PD_KVW_PROBE};
    q.u.probe.nonce = 7;
    q.u.probe.bytes = PD_KVW_PROBE_MAX + 4;  // over the cap: refused by the decoder
    PD_CHECK_EQ(pd_kvw_encode(&b, &q), PD_OK);
    PD_CHECK_EQ(pd_kvw_decode(b.data, b.len, &d, &used, &err), PD_ERR_PROTO);
    pd_kvw_msg_fini(&d);
    pd_kvw_buf_fini(&b);
}
