// Disaggregated prefill/decode inside one process: a PREFILL engine and a DECODE engine talking
// over loopback (tcp and shm transports). Greedy outputs must equal the golden continuations with
// every prompt's KV handed off (no local prefill), a corrupted transfer must be detected and
// recomputed (never decoded from), and an unreachable prefill worker must fall back. The timeout
// / block-reuse race: a timed-out request keeps its blocks until the (slow) worker answers, at the
// engine level (a late write must not corrupt the request that reuses the blocks) and at the xfer
// level (when the RESULT is reported, and the grace period for a worker that never answers).
#include <jansson.h>
#include <poll.h>
#include <pthread.h>

#include "engine/engine.h"
#include "test.h"
#include "xfer/xfer.h"

#define SECRET "test-secret-0123456789abcdef"

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
    p.disagg_timeout_ms = 120000;  // a safety net only: sanitizer builds on a loaded box are slow
    p.debug_corrupt_every = corrupt_every;
    p.kv_secret = SECRET;
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
    int64_t deadline = pd_test_deadline_us(60);
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

// Submits one greedy request and waits for it; returns the number of tokens (out: up to 64).
static int run_one(pd_engine *d, uint64_t id, const int32_t *p, int n, int max_tokens, int32_t *out) {
    pd_err err = {0};
    pd_engine_request q = {.id = id, .prompt = p, .n_prompt = n, .max_tokens = max_tokens, .ignore_eos = true,
                           .sampling = pd_sampling_params_default()};
    q.sampling.temperature = 0;
    PD_CHECK_EQ(pd_engine_submit(d, &q, &err), PD_OK);
    int n_out = 0;
    bool done = false;
    int64_t deadline = pd_test_deadline_us(30);
    while (!done && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(d), .events = POLLIN};
        poll(&pfd, 1, 20);
        pd_engine_event ev[16];
        int k;
        while ((k = pd_engine_poll(d, ev, 16)) > 0)
            for (int i = 0; i < k; i++) {
                if (ev[i].id != id) continue;
                if (ev[i].kind == PD_EV_TOKEN && n_out < 64) out[n_out++] = ev[i].tok.token;
                if (ev[i].kind == PD_EV_FINISHED) done = true;
            }
    }
    PD_CHECK(done);
    return n_out;
}

static void check_greedy(json_t *g, int prompt, const int32_t *out, int n, const char *what) {
    json_t *gr = json_object_get(json_array_get(json_object_get(g, "prompts"), (size_t)prompt), "greedy");
    for (int k = 0; k < n; k++) {
        if (json_number_value(json_object_get(json_array_get(json_object_get(gr, "steps"), (size_t)k), "margin")) < 1e-3) break;
        int want = (int)json_integer_value(json_array_get(json_object_get(gr, "new_ids"), (size_t)k));
        if (out[k] != want) {
            PD_FAIL_("%s: step %d: %d != %d", what, k, out[k], want);
            return;
        }
    }
}

static int golden_prompt(json_t *g, int i, int32_t *p) {
    json_t *ids = json_object_get(json_array_get(json_object_get(g, "prompts"), (size_t)i), "prompt_ids");
    int n = (int)json_array_size(ids);
    for (int j = 0; j < n; j++) p[j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
    return n;
}

// The timeout / block-reuse race: a slow but alive prefill worker (test hook: it sleeps 800 ms
// before writing a prompt's KV into the decode pool over shm) and a decode side that times the
// request out after 150 ms. The decode pool has exactly the blocks of that request (19), so the
// next request B must reuse them. Without holding the timed-out request's blocks until the worker
// answers, the late write lands in B's blocks (then in the prefix cache): C, B's prompt again,
// would decode from A's KV. With the fix every output equals the golden greedy continuation.
PD_TEST(disagg_timeout_keeps_blocks_until_worker_answers) {
    json_t *g = golden();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/kjv-llama-6m", pd_test_models_dir());
    pd_engine_params pp = pd_engine_params_default();
    pp.model_dir = dir, pp.device = "cpu", pp.n_blocks = 256, pp.role = PD_ROLE_PREFILL;
    pp.kv_transport = PD_KVW_TRANSPORT_SHM, pp.debug_export_delay_ms = 800, pp.kv_secret = SECRET;
    pd_err err = {0};
    pd_engine *pf = pd_engine_new(&pp, &err);
    PD_REQUIRE(pf);
    PD_CHECK_EQ(pd_engine_start(pf), PD_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
    pd_engine_params dp = pd_engine_params_default();
    dp.model_dir = dir, dp.device = "cpu", dp.role = PD_ROLE_DECODE, dp.kv_transport = PD_KVW_TRANSPORT_SHM;
    dp.n_blocks = 19;             // 300 prompt + 4 generated tokens = 19 blocks of 16: the whole pool
    dp.disagg_min_tokens = 100;   // only the 300-token prompt is handed off
    dp.disagg_timeout_ms = 150;
    dp.n_prefill_addrs = 1, dp.prefill_addrs[0] = addr, dp.kv_secret = SECRET;
    pd_engine *d = pd_engine_new(&dp, &err);
    if (!d) PD_FAIL_("decode engine: %s", err.msg);
    PD_REQUIRE(d);
    PD_CHECK_EQ(pd_engine_start(d), PD_OK);
    wait_healthy(d);
    int32_t a[512], b[64], out[64];
    int na = golden_prompt(g, 3, a), nb = golden_prompt(g, 2, b);
    PD_REQUIRE(na == 300 && nb == 20);
    int64_t t0 = pd_time_us();
    int n = run_one(d, 1, a, na, 4, out);  // times out, then is prefilled locally
    PD_CHECK_EQ(n, 4);
    check_greedy(g, 3, out, n, "A (timed out)");
    n = run_one(d, 2, b, nb, 16, out);     // reuses A's blocks
    check_greedy(g, 2, out, n, "B (reused blocks)");
    int64_t late = t0 + 1600000 - pd_time_us();  // past the slow worker's write
    if (late > 0) poll(NULL, 0, (int)(late / 1000));
    n = run_one(d, 3, b, nb, 16, out);     // decodes from B's cached prefix block
    PD_CHECK_EQ(n, 16);
    check_greedy(g, 2, out, n, "C (B's cached prefix after the late write)");
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_TIMEOUT], 1);
    PD_CHECK_EQ(st.n_kv_handoffs, 0);
    pd_engine_free(d);
    pd_engine_free(pf);
    json_decref(g);
}

// ---- the timeout protocol at the xfer level: a real server and client on loopback, the "prefill
// worker" being the test's event callback (it never computes anything) -------------------------

typedef struct slow_pf {
    pd_xfer_server *s;
    pthread_mutex_t mu;
    int n_req, n_cancel;
    int answer_delay_ms;   // < 0: never answer a CANCEL
    int64_t t_answer_us;   // when the FAIL("cancelled") left
} slow_pf;

static void slow_pf_event(void *ud, pd_xfer_event *ev) {
    slow_pf *f = ud;
    pthread_mutex_lock(&f->mu);
    if (ev->kind == PD_XFER_EV_REQUEST) f->n_req++;
    if (ev->kind == PD_XFER_EV_CANCEL) f->n_cancel++;
    pthread_mutex_unlock(&f->mu);
    if (ev->kind == PD_XFER_EV_CANCEL && f->answer_delay_ms >= 0) {
        poll(NULL, 0, f->answer_delay_ms);  // still "writing" the blocks
        pd_kvw_msg m = {.type = PD_KVW_PREFILL_FAIL};
        m.u.fail.req_id = ev->req_id;
        snprintf(m.u.fail.reason, sizeof m.u.fail.reason, "cancelled");
        pthread_mutex_lock(&f->mu);
        f->t_answer_us = pd_time_us();
        pthread_mutex_unlock(&f->mu);
        pd_xfer_server_send(f->s, ev->conn_id, &m, NULL);
    }
}

typedef struct got_result {
    pthread_mutex_t mu;
    int n;
    pd_status st;
    int64_t t_us;
} got_result;

static void got_result_event(void *ud, pd_xfer_event *ev) {
    got_result *g = ud;
    if (ev->kind != PD_XFER_EV_RESULT) return;
    pthread_mutex_lock(&g->mu);
    g->n++;
    g->st = ev->status;
    g->t_us = pd_time_us();
    pthread_mutex_unlock(&g->mu);
}

// Returns the time from the request to its RESULT (ms); *st gets the status.
static double timed_out_request(slow_pf *f, int grace_ms, pd_status *st) {
    pthread_mutex_init(&f->mu, NULL);
    pd_xfer_server_params sp = {.port = 0, .secret = SECRET, .on_event = slow_pf_event, .ud = f};
    pd_err err = {0};
    f->s = pd_xfer_server_new(&sp, &err);
    if (!f->s) {
        PD_FAIL_("xfer server: %s", err.msg);
        return -1;
    }
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_xfer_server_port(f->s));
    got_result g = {.n = 0};
    pthread_mutex_init(&g.mu, NULL);
    pd_xfer_client_params cp = {.n_workers = 1, .addrs = {addr}, .transport = PD_KVW_TRANSPORT_TCP, .timeout_ms = 100,
                                .cancel_grace_ms = grace_ms, .ping_ms = 200, .on_event = got_result_event, .ud = &g,
                                .secret = SECRET, .pool = {.n_layers = 1, .n_blocks = 4, .block_size = 16, .row_bytes = 8}};
    pd_xfer_client *c = pd_xfer_client_new(&cp, &err);
    if (!c) {
        PD_FAIL_("xfer client: %s", err.msg);
        pd_xfer_server_free(f->s);
        return -1;
    }
    for (int i = 0; i < 300 && pd_xfer_client_n_healthy(c) == 0; i++) poll(NULL, 0, 10);
    PD_CHECK_EQ(pd_xfer_client_n_healthy(c), 1);
    int32_t toks[3] = {1, 2, 3}, blk[1] = {0};
    pd_kvw_prefill_req r = {.req_id = 42, .start_pos = 0, .n_tokens = 3, .tokens = toks, .n_dst_blocks = 1, .dst_blocks = blk};
    int64_t t0 = pd_time_us();
    PD_CHECK_EQ(pd_xfer_client_prefill(c, &r), PD_OK);
    for (int i = 0; i < 500; i++) {
        pthread_mutex_lock(&g.mu);
        int n = g.n;
        pthread_mutex_unlock(&g.mu);
        if (n) break;
        poll(NULL, 0, 10);
    }
    PD_CHECK_EQ(g.n, 1);
    *st = g.st;
    double ms = (double)(g.t_us - t0) / 1000.0;
    pd_xfer_client_free(c);
    pd_xfer_server_free(f->s);
    PD_CHECK_EQ(g.n, 1);  // exactly one RESULT, also after the connection closed
    pthread_mutex_destroy(&g.mu);
    pthread_mutex_destroy(&f->mu);
    return ms;
}

// A timed-out request is reported only once the worker answered the CANCEL (its blocks are free
// from then on), not at its deadline.
PD_TEST(xfer_timeout_result_waits_for_the_worker_answer) {
    slow_pf f = {.answer_delay_ms = 400};
    pd_status st;
    double ms = timed_out_request(&f, 5000, &st);
    PD_CHECK_EQ(st, PD_ERR_TIMEOUT);
    PD_CHECK_EQ(f.n_req, 1);
    PD_CHECK_EQ(f.n_cancel, 1);
    PD_CHECK(ms >= 100 + 400 - 20);  // deadline, then the worker's 400 ms until its answer
    PD_CHECK(ms < 3000);             // well before the grace period
}

// A worker that never answers is cut off after the grace period (then the request is reported).
PD_TEST(xfer_timeout_unanswered_drops_the_worker_after_grace) {
    slow_pf f = {.answer_delay_ms = -1};
    pd_status st;
    double ms = timed_out_request(&f, 300, &st);
    PD_CHECK_EQ(st, PD_ERR_TIMEOUT);
    PD_CHECK_EQ(f.n_cancel, 1);
    PD_CHECK(ms >= 100 + 300 - 20);
    PD_CHECK(ms < 3000);
}

// Seeded sampling: a temperature-1 request with a seed draws the same tokens handed off as
// prefilled locally — the first token is drawn remotely, and the decode side continues the remote
// sampler's draw counter (PREFILL_DONE n_draws), not its own (which made the draws differ).
static int run_seeded(pd_engine *d, uint64_t id, const int32_t *p, int n, int32_t *out) {
    pd_err err = {0};
    pd_engine_request q = {.id = id, .prompt = p, .n_prompt = n, .max_tokens = 24, .ignore_eos = true,
                           .sampling = pd_sampling_params_default()};
    q.sampling.temperature = 1.0f;
    q.sampling.seed = 4242;
    q.sampling.has_seed = true;
    PD_CHECK_EQ(pd_engine_submit(d, &q, &err), PD_OK);
    int n_out = 0;
    bool done = false;
    int64_t deadline = pd_test_deadline_us(60);
    while (!done && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(d), .events = POLLIN};
        poll(&pfd, 1, 20);
        pd_engine_event ev[16];
        int k;
        while ((k = pd_engine_poll(d, ev, 16)) > 0)
            for (int i = 0; i < k; i++) {
                if (ev[i].id != id) continue;
                if (ev[i].kind == PD_EV_TOKEN && n_out < 64) out[n_out++] = ev[i].tok.token;
                if (ev[i].kind == PD_EV_FINISHED) done = true;
            }
    }
    PD_CHECK(done);
    return n_out;
}

PD_TEST(disagg_seeded_sampling_same_as_local) {
    json_t *g = golden();
    int32_t p[512], local[64], remote[64];
    int n = golden_prompt(g, 1, p);
    pd_engine *both = mk(PD_ROLE_BOTH, PD_KVW_TRANSPORT_TCP, NULL, 0);
    PD_REQUIRE(both);
    int nl = run_seeded(both, 1, p, n, local);
    pd_engine_free(both);
    for (int t = 0; t < 2; t++) {
        pd_kvw_transport tr = t ? PD_KVW_TRANSPORT_SHM : PD_KVW_TRANSPORT_TCP;
        pd_engine *pf = mk(PD_ROLE_PREFILL, tr, NULL, 0);
        PD_REQUIRE(pf);
        char addr[64];
        snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
        pd_engine *d = mk(PD_ROLE_DECODE, tr, addr, 0);
        wait_healthy(d);
        int nr = run_seeded(d, 2, p, n, remote);
        pd_engine_stats st;
        pd_engine_stats_get(d, &st);
        PD_CHECK_EQ(st.n_kv_handoffs, 1);
        PD_CHECK_EQ(nr, nl);
        for (int i = 0; i < nl && i < nr; i++)
            if (local[i] != remote[i]) {
                PD_FAIL_("%s: seeded token %d: local %d, handed off %d", pd_kvw_transport_name(tr), i, local[i], remote[i]);
                break;
            }
        pd_engine_free(d);
        pd_engine_free(pf);
    }
    json_decref(g);
}

// A decode pool that the prefill worker refuses (test hook: as if it did not check out) is counted
// apart: the prefill worker counts the refused pool, every handoff on that connection gets
// PREFILL_FAIL with the pool-refused code at once, and the decode worker prefills locally (outputs
// still right) counting each as a fallback with reason pool_refused — not as a generic error.
PD_TEST(disagg_refused_pool_counted_as_fallback) {
    json_t *g = golden();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/kjv-llama-6m", pd_test_models_dir());
    pd_engine_params pp = pd_engine_params_default();
    pp.model_dir = dir, pp.device = "cpu", pp.n_blocks = 256, pp.role = PD_ROLE_PREFILL;
    pp.kv_transport = PD_KVW_TRANSPORT_SHM, pp.kv_secret = SECRET, pp.debug_refuse_kv_pools = true;
    pd_err err = {0};
    pd_engine *pf = pd_engine_new(&pp, &err);
    PD_REQUIRE(pf);
    PD_CHECK_EQ(pd_engine_start(pf), PD_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
    pd_engine *d = mk(PD_ROLE_DECODE, PD_KVW_TRANSPORT_SHM, addr, 0);
    wait_healthy(d);
    outs o;
    run(d, g, &o);
    check(g, &o, "refused decode pool");
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_POOL_REFUSED], 6);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_ERROR], 0);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_TIMEOUT], 0);
    PD_CHECK_EQ(st.n_kv_handoffs, 0);
    PD_CHECK_STR(pd_fallback_reason_name(PD_FALLBACK_POOL_REFUSED), "pool_refused");
    pd_engine_stats ps;
    pd_engine_stats_get(pf, &ps);
    PD_CHECK(ps.n_kv_peers_refused >= 1);
    PD_CHECK_EQ(ps.n_blocks_used, 0);
    pd_engine_free(d);
    pd_engine_free(pf);
    json_decref(g);
}

// A prefill step that fails (out of memory: test hook) tells the decode worker at once
// (PREFILL_FAIL): its requests fall back right away, not after the 20 s handoff timeout, and their
// outputs are still right. Colocated, a failed step fails its requests with an error event: no
// client is left waiting.
PD_TEST(disagg_failed_prefill_step_fails_at_once) {
    json_t *g = golden();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/kjv-llama-6m", pd_test_models_dir());
    pd_engine_params pp = pd_engine_params_default();
    pp.model_dir = dir, pp.device = "cpu", pp.n_blocks = 256, pp.role = PD_ROLE_PREFILL;
    pp.kv_transport = PD_KVW_TRANSPORT_TCP, pp.kv_secret = SECRET, pp.debug_fail_step_every = 1;  // every step
    pd_err err = {0};
    pd_engine *pf = pd_engine_new(&pp, &err);
    PD_REQUIRE(pf);
    PD_CHECK_EQ(pd_engine_start(pf), PD_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pd_engine_kv_port(pf));
    pd_engine *d = mk(PD_ROLE_DECODE, PD_KVW_TRANSPORT_TCP, addr, 0);
    wait_healthy(d);
    outs o;
    run(d, g, &o);
    check(g, &o, "failed prefill steps");
    pd_engine_stats st;
    pd_engine_stats_get(d, &st);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_ERROR], 6);
    PD_CHECK_EQ(st.n_kv_fallbacks[PD_FALLBACK_TIMEOUT], 0);  // without PREFILL_FAIL they would all time out
    pd_engine_stats ps;
    pd_engine_stats_get(pf, &ps);
    PD_CHECK_EQ(ps.n_kv_saves_failed, 6);
    PD_CHECK_EQ(ps.n_blocks_used, 0);
    pd_engine_free(d);
    pd_engine_free(pf);

    pd_engine_params cp = pd_engine_params_default();
    cp.model_dir = dir, cp.device = "cpu", cp.n_blocks = 256, cp.debug_fail_step_every = 3;
    pd_engine *c = pd_engine_new(&cp, &err);
    PD_REQUIRE(c);
    PD_CHECK_EQ(pd_engine_start(c), PD_OK);
    int32_t p[512];
    int n = golden_prompt(g, 0, p), errors = 0, finished = 0;
    for (int i = 0; i < 8; i++) {
        pd_engine_request q = {.id = (uint64_t)i + 1, .prompt = p, .n_prompt = n, .max_tokens = 8, .ignore_eos = true,
                               .sampling = pd_sampling_params_default()};
        PD_CHECK_EQ(pd_engine_submit(c, &q, &err), PD_OK);
    }
    int64_t deadline = pd_test_deadline_us(60);
    while (finished < 8 && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(c), .events = POLLIN};
        poll(&pfd, 1, 20);
        pd_engine_event ev[16];
        int k;
        while ((k = pd_engine_poll(c, ev, 16)) > 0)
            for (int i = 0; i < k; i++)
                if (ev[i].kind == PD_EV_FINISHED) finished++, errors += ev[i].finish == PD_ENGINE_FINISH_ERROR;
    }
    PD_CHECK_EQ(finished, 8);  // every client hears the end of its request
    PD_CHECK(errors >= 1);
    pd_engine_free(c);
    json_decref(g);
}
