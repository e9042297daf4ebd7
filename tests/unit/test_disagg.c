// Disaggregated prefill/decode inside one process: a PREFILL engine and a DECODE engine talking
// over loopback (tcp and shm transports). Greedy outputs must equal the golden continuations with
// every prompt's KV handed off (no local prefill), a corrupted transfer must be detected and
// recomputed (never decoded from), and an unreachable prefill worker must fall back.
#include <jansson.h>
#include <poll.h>

#include "engine/engine.h"
#include "test.h"

typedef struct outs {
    int n;
    int32_t out[16][64];
    int n_out[16];
    int finished[16];
} outs;

static json_t *golden(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/golden/kjv-llama-6m.json", pd_test_models_dir());
    return json_load_file(p, 0, NULL);
}

static pd_engine *mk(pd_engine_role role, pd_kvw_transport tr, const char *prefill_addr, int corrupt_every) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/kjv-llama-6m", pd_test_models_dir());
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = dir;
    p.device = "cpu";
    p.n_blocks = 256;
    p.role = role;
    p.kv_transport = tr;
    p.disagg_min_tokens = 1;  // hand off every prompt, even 1 token
    p.disagg_timeout_ms = 20000;
    p.debug_corrupt_every = corrupt_every;
    if (prefill_addr) {
        p.n_prefill_addrs = 1;
        p.prefill_addrs[0] = prefill_addr;
    }
    pd_err err = {0};
    pd_engine *e = pd_engine_new(&p, &err);
    if (!e) PD_FAIL_("engine: %s", err.msg);
    else PD_CHECK_EQ(pd_engine_start(e), PD_OK);
    return e;
}

// Runs the 6 golden prompts (greedy, 48 tokens) on the decode engine.
static void run(pd_engine *d, json_t *g, outs *o) {
    json_t *prompts = json_object_get(g, "prompts");
    o->n = (int)json_array_size(prompts);
    pd_err err = {0};
    for (int i = 0; i < o->n; i++) {
        json_t *ids = json_object_get(json_array_get(prompts, (size_t)i), "prompt_ids");
        int32_t p[512];
        int n = (int)json_array_size(ids);
        for (int j = 0; j < n; j++) p[j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
        pd_engine_request q = {.id = (uint64_t)i + 1, .prompt = p, .n_prompt = n, .max_tokens = 48, .ignore_eos = true,
                               .sampling = pd_sampling_params_default()};
        q.sampling.temperature = 0;
        o->n_out[i] = 0;
        o->finished[i] = 0;
        PD_CHECK_EQ(pd_engine_submit(d, &q, &err), PD_OK);
    }
    int done = 0;
    int64_t deadline = pd_time_us() + 60000000;
    while (done < o->n && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(d), .events = POLLIN};
        poll(&pfd, 1, 100);
        pd_engine_event ev[32];
        int n;
        while ((n = pd_engine_poll(d, ev, 32)) > 0)
            for (int k = 0; k < n; k++) {
                int i = (int)ev[k].id - 1;
                if (ev[k].kind == PD_EV_TOKEN && o->n_out[i] < 64) o->out[i][o->n_out[i]++] = ev[k].tok.token;
                if (ev[k].kind == PD_EV_FINISHED) o->finished[i] = ev[k].finish, done++;
            }
    }
    PD_CHECK_EQ(done, o->n);
    for (int i = 0; i < 200; i++) {  // stats are published after each step: wait for the last one
        pd_engine_stats st;
        pd_engine_stats_get(d, &st);
        if (st.n_running == 0 && st.n_waiting == 0 && st.n_blocks_used == 0) break;
        poll(NULL, 0, 10);
    }
}

static void check(json_t *g, outs *o, const char *what) {
    json_t *prompts = json_object_get(g, "prompts");
    for (int i = 0; i < o->n; i++) {
        json_t *gr = json_object_get(json_array_get(prompts, (size_t)i), "greedy");
        PD_CHECK_EQ(o->finished[i], PD_ENGINE_FINISH_LENGTH);
        PD_CHECK_EQ(o->n_out[i], 48);
        for (int k = 0; k < o->n_out[i]; k++) {
            if (json_number_value(json_object_get(json_array_get(json_object_get(gr, "steps"), (size_t)k), "margin")) < 1e-3) break;
            int want = (int)json_integer_value(json_array_get(json_object_get(gr, "new_ids"), (size_t)k));
            if (o->out[i][k] != want) {
                PD_FAIL_("%s: prompt %d step %d: %d != %d", what, i, k, o->out[i][k], want);
                break;
            }
        }
    }
}

static void wait_healthy(pd_engine *d) {
    // The decode side connects in the background; until then prompts would be prefilled locally.
    for (int i = 0; i < 500; i++) {
        pd_engine_stats st;
        pd_engine_stats_get(d, &st);
        (void)st;
        if (pd_engine_n_prefill_healthy(d) > 0) return;
        poll(NULL, 0, 10);
    }
    PD_FAIL_("decode engine never connected to the prefill engine");
}

static void handoff(pd_kvw_transport tr, const char *name) {
    json_t *g = golden();
    pd_engine *pf = mk(PD_ROLE_PREFILL, tr, NULL, 0);
    PD_REQUIRE(pf);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
    pd_engine *d = mk(PD_ROLE_DECODE, tr, addr, 0);
    PD_REQUIRE(d);
    wait_healthy(d);
    outs o;
    run(d, g, &o);
    check(g, &o, name);
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_handoffs, 6);
    for (int r = 0; r < PD_FALLBACK_N; r++) PD_CHECK_EQ(st.n_kv_fallbacks[r], 0);
    PD_CHECK_EQ(st.n_prefill_tokens_computed, 0);  // no prompt was recomputed on the decode side
    PD_CHECK_EQ(st.n_blocks_used, 0);
    printf("  %s: %lld handoffs, %lld bytes, %.2f ms mean\n", name, (long long)st.n_kv_handoffs, (long long)st.n_kv_handoff_bytes,
           st.n_kv_handoffs ? (double)st.kv_handoff_us_total / 1000.0 / (double)st.n_kv_handoffs : 0.0);
    pd_engine_free(d);
    pd_engine_free(pf);
    json_decref(g);
}

PD_TEST(disagg_tcp_matches_golden) { handoff(PD_KVW_TRANSPORT_TCP, "tcp"); }
PD_TEST(disagg_shm_matches_golden) { handoff(PD_KVW_TRANSPORT_SHM, "shm"); }

static void corrupted(pd_kvw_transport tr) {
    json_t *g = golden();
    pd_engine *pf = mk(PD_ROLE_PREFILL, tr, NULL, 2);  // every 2nd transfer is corrupted
    PD_REQUIRE(pf);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
    pd_engine *d = mk(PD_ROLE_DECODE, tr, addr, 0);
    wait_healthy(d);
    outs o;
    run(d, g, &o);
    check(g, &o, "corrupted");  // still right: the bad KV was detected and recomputed
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_CHECKSUM], 3);
    PD_CHECK_EQ(st.n_kv_handoffs, 3);
    pd_engine_free(d);
    pd_engine_free(pf);
    json_decref(g);
}
PD_TEST(disagg_corrupt_slab_detected_tcp) { corrupted(PD_KVW_TRANSPORT_TCP); }
PD_TEST(disagg_corrupt_write_detected_shm) { corrupted(PD_KVW_TRANSPORT_SHM); }

PD_TEST(disagg_no_prefill_worker_falls_back) {
    json_t *g = golden();
    pd_engine *d = mk(PD_ROLE_DECODE, PD_KVW_TRANSPORT_SHM, "127.0.0.1:1", 0);  // nothing listens there
    PD_REQUIRE(d);
    outs o;
    run(d, g, &o);
    check(g, &o, "no worker");
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_handoffs, 0);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_UNAVAILABLE], 6);
    pd_engine_free(d);
    json_decref(g);
}
