// Engine tests on the CPU with the bundled model: greedy outputs equal the golden continuations
// whatever the scheduling (prefix caching on/off, chunk budgets, alone or among 32 concurrent
// requests, a KV pool so small that requests are preempted), aborts free everything, and shared
// prefixes show up as cached tokens and less prefill work.
#include <jansson.h>
#include <poll.h>

#include "engine/engine.h"
#include "test.h"

#define MAXR 64
#define MAXOUT 64

typedef struct run {
    int n;
    int32_t *prompts[MAXR];
    int n_prompt[MAXR];
    int max_tokens;
    int32_t out[MAXR][MAXOUT];
    int n_out[MAXR];
    pd_engine_finish finish[MAXR];
    int cached[MAXR];
    bool abort_after_first[MAXR];
} run;

static const char *model_dir(char *buf, size_t n) {
    snprintf(buf, n, "%s/kjv-llama-6m", pd_test_models_dir());
    return buf;
}

// Submits all requests, then drains events until every request finished (or 60 s pass).
static pd_engine_stats run_engine(const pd_engine_params *p0, run *r) {
    char dir[512];
    pd_engine_params p = *p0;
    p.model_dir = model_dir(dir, sizeof dir);
    p.device = "cpu";
    pd_err err = {0};
    pd_engine_stats st = {0};
    pd_engine *e = pd_engine_new(&p, &err);
    if (!e) {
        PD_FAIL_("engine: %s", err.msg);
        return st;
    }
    PD_CHECK_EQ(pd_engine_start(e), PD_OK);
    for (int i = 0; i < r->n; i++) {
        pd_engine_request q = {.id = (uint64_t)i + 100, .prompt = r->prompts[i], .n_prompt = r->n_prompt[i],
                               .max_tokens = r->max_tokens, .ignore_eos = true, .sampling = pd_sampling_params_default()};
        q.sampling.temperature = 0;
        r->n_out[i] = 0;
        r->finish[i] = 0;
        PD_CHECK_EQ(pd_engine_submit(e, &q, &err), PD_OK);
    }
    int done = 0;
    int64_t deadline = pd_test_deadline_us(60);
    while (done < r->n && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(e), .events = POLLIN};
        poll(&pfd, 1, 100);
        pd_engine_event ev[64];
        int n;
        while ((n = pd_engine_poll(e, ev, 64)) > 0) {
            for (int k = 0; k < n; k++) {
                int i = (int)(ev[k].id - 100);
                if (i < 0 || i >= r->n) {
                    PD_FAIL_("event for unknown id %llu", (unsigned long long)ev[k].id);
                    continue;
                }
                if (ev[k].kind == PD_EV_TOKEN) {
                    PD_CHECK(r->finish[i] == 0);
                    if (r->n_out[i] < MAXOUT) r->out[i][r->n_out[i]++] = ev[k].tok.token;
                    if (r->abort_after_first[i] && r->n_out[i] == 1) pd_engine_abort(e, ev[k].id);
                } else {
                    PD_CHECK_MSG(r->finish[i] == 0, "request %d finished twice", i);
                    r->finish[i] = ev[k].finish;
                    r->cached[i] = ev[k].n_cached_tokens;
                    done++;
                }
            }
        }
    }
    PD_CHECK_EQ(done, r->n);
    // The engine publishes stats after each step; wait for the final snapshot.
    for (int i = 0; i < 100; i++) {
        pd_engine_stats_get(e, &st);
        if (st.n_running == 0 && st.n_waiting == 0) break;
        poll(NULL, 0, 10);
    }
    pd_engine_free(e);
    return st;
}

static json_t *g_golden;
static json_t *golden(void) {
    if (!g_golden) {
        char p[512];
        snprintf(p, sizeof p, "%s/golden/kjv-llama-6m.json", pd_test_models_dir());
        g_golden = json_load_file(p, 0, NULL);
    }
    return g_golden;
}

// The 6 golden prompts, each `copies` times (all requests of one prompt must agree with golden).
static void load_prompts(run *r, int copies) {
    json_t *prompts = json_object_get(golden(), "prompts");
    r->n = 0;
    for (int c = 0; c < copies; c++)
        for (size_t i = 0; i < json_array_size(prompts); i++) {
            json_t *ids = json_object_get(json_array_get(prompts, i), "prompt_ids");
            int k = r->n++;
            r->n_prompt[k] = (int)json_array_size(ids);
            r->prompts[k] = pd_malloc(sizeof(int32_t) * (size_t)r->n_prompt[k]);
            for (int j = 0; j < r->n_prompt[k]; j++) r->prompts[k][j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
        }
    r->max_tokens = 48;
}

static void free_prompts(run *r) {
    for (int i = 0; i < r->n; i++) pd_free(r->prompts[i]);
}

// Compares with golden up to the first step whose margin is below 1e-3.
static void check_golden(run *r, const char *what) {
    json_t *prompts = json_object_get(golden(), "prompts");
    size_t np = json_array_size(prompts);
    for (int i = 0; i < r->n; i++) {
        if (r->abort_after_first[i]) continue;
        json_t *g = json_object_get(json_array_get(prompts, (size_t)i % np), "greedy");
        json_t *ids = json_object_get(g, "new_ids"), *steps = json_object_get(g, "steps");
        PD_CHECK_EQ(r->finish[i], PD_ENGINE_FINISH_LENGTH);
        PD_CHECK_EQ(r->n_out[i], r->max_tokens);
        for (int k = 0; k < r->n_out[i]; k++) {
            if (json_number_value(json_object_get(json_array_get(steps, (size_t)k), "margin")) < 1e-3) break;
            int want = (int)json_integer_value(json_array_get(ids, (size_t)k));
            if (r->out[i][k] != want) {
                PD_FAIL_("%s: request %d step %d: got %d want %d", what, i, k, r->out[i][k], want);
                break;
            }
        }
    }
}

PD_TEST(engine_greedy_matches_golden_under_all_schedules) {
    struct { bool prefix; int budget; int copies; const char *name; } cases[] = {
        {true, 2048, 1, "alone-ish, prefix on, budget 2048"},
        {false, 2048, 1, "prefix off"},
        {true, 16, 1, "budget 16"},
        {true, 64, 1, "budget 64"},
        {true, 2048, 6, "36 concurrent"},
        {false, 64, 6, "36 concurrent, prefix off, budget 64"},
    };
    for (size_t c = 0; c < PD_ARRAY_LEN(cases); c++) {
        run *r = pd_calloc(1, sizeof *r);
        load_prompts(r, cases[c].copies);
        pd_engine_params p = pd_engine_params_default();
        p.enable_prefix_caching = cases[c].prefix;
        p.max_num_batched_tokens = cases[c].budget;
        p.n_blocks = 512;
        pd_engine_stats st = run_engine(&p, r);
        check_golden(r, cases[c].name);
        PD_CHECK_EQ(st.n_blocks_used, 0);  // every block back in the pool
        PD_CHECK_EQ(st.n_blocks_free, 512);
        free_prompts(r);
        pd_free(r);
    }
}

// A pool that cannot hold every request at once: preemption + recompute must still give the golden
// tokens and leave no block behind.
PD_TEST(engine_memory_pressure_preempts_and_completes) {
    run *r = pd_calloc(1, sizeof *r);
    load_prompts(r, 4);  // 24 requests; heldout_300 alone needs 22 blocks of 16
    pd_engine_params p = pd_engine_params_default();
    p.n_blocks = 40;
    p.max_num_batched_tokens = 256;
    pd_engine_stats st = run_engine(&p, r);
    check_golden(r, "memory pressure");
    PD_CHECK_MSG(st.n_preemptions > 0, "expected preemptions with 40 blocks, got %lld", (long long)st.n_preemptions);
    PD_CHECK_EQ(st.n_blocks_used, 0);
    printf("  preemptions: %lld\n", (long long)st.n_preemptions);
    free_prompts(r);
    pd_free(r);
}

// Shared prefixes: the second wave is served from the prefix cache (cached tokens reported, fewer
// prompt tokens computed), and aborts in flight return their blocks.
PD_TEST(engine_prefix_hits_and_aborts) {
    run *r = pd_calloc(1, sizeof *r);
    // 16 requests sharing a 200-token prefix with distinct 10-token tails.
    json_t *pr = json_array_get(json_object_get(golden(), "prompts"), 3);  // heldout_300
    json_t *ids = json_object_get(pr, "prompt_ids");
    r->n = 16;
    r->max_tokens = 8;
    for (int i = 0; i < r->n; i++) {
        r->n_prompt[i] = 210;
        r->prompts[i] = pd_malloc(sizeof(int32_t) * 210);
        for (int j = 0; j < 200; j++) r->prompts[i][j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
        for (int j = 200; j < 210; j++) r->prompts[i][j] = (int32_t)(100 + i * 10 + j - 200);
        r->abort_after_first[i] = i % 4 == 3;
    }
    pd_engine_params p = pd_engine_params_default();
    p.n_blocks = 512;
    p.max_num_batched_tokens = 512;  // the first request's prefill fills the cache before most others start
    pd_engine_stats st = run_engine(&p, r);
    int n_cached = 0;
    for (int i = 0; i < r->n; i++) n_cached += r->cached[i];
    PD_CHECK_MSG(n_cached >= 8 * 192, "cached tokens %d", n_cached);
    PD_CHECK_MSG(st.n_prefill_tokens_computed < 16 * 210 / 2, "prefill computed %lld of %d", (long long)st.n_prefill_tokens_computed, 16 * 210);
    PD_CHECK(st.n_prefix_hit_tokens > 0);
    for (int i = 0; i < r->n; i++)
        if (r->abort_after_first[i]) PD_CHECK_EQ(r->finish[i], PD_ENGINE_FINISH_ABORT);
    PD_CHECK_EQ(st.n_blocks_used, 0);
    printf("  cached tokens %d, prefill tokens computed %lld of %d\n", n_cached, (long long)st.n_prefill_tokens_computed, 16 * 210);
    free_prompts(r);
    pd_free(r);
    json_decref(g_golden);
    g_golden = NULL;
}

// The kjv-llama-6m engine on the CPU with a 64-block pool (NULL and err set when it cannot start).
static pd_engine *small_engine(pd_err *err) {
    char dir[512];
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = model_dir(dir, sizeof dir);
    p.device = "cpu";
    p.n_blocks = 64;
    return pd_engine_new(&p, err);
}

// The engine's 0/1 measurement switches (pd_env_switch): a value other than 0 or 1 is refused at
// start with the variable named, not read as the default.
PD_TEST(engine_refuses_a_mistyped_switch) {
    PD_CHECK_EQ(setenv("PDSERVE_SCHED_BACKFILL", "yes", 1), 0);
    pd_err err = {0};
    pd_engine *e = small_engine(&err);
    PD_CHECK(!e);
    PD_CHECK_CONTAINS(err.msg, "PDSERVE_SCHED_BACKFILL=yes: want 0 or 1");
    if (e) pd_engine_free(e);
    bool v = false;
    PD_CHECK_EQ(setenv("PDSERVE_SCHED_BACKFILL", "1", 1), 0);
    PD_CHECK_EQ(pd_env_switch("PDSERVE_SCHED_BACKFILL", false, &v, NULL), PD_OK);
    PD_CHECK(v);
    PD_CHECK_EQ(setenv("PDSERVE_SCHED_BACKFILL", "", 1), 0);
    PD_CHECK_EQ(pd_env_switch("PDSERVE_SCHED_BACKFILL", true, &v, NULL), PD_OK);
    PD_CHECK(v);
    PD_CHECK_EQ(setenv("PDSERVE_SCHED_BACKFILL", "0", 1), 0);
    PD_CHECK_EQ(pd_env_switch("PDSERVE_SCHED_BACKFILL", true, &v, NULL), PD_OK);
    PD_CHECK(!v);
    PD_CHECK_EQ(setenv("PDSERVE_SCHED_BACKFILL", "10", 1), 0);
    PD_CHECK_EQ(pd_env_switch("PDSERVE_SCHED_BACKFILL", true, &v, NULL), PD_ERR_INVALID);
    PD_CHECK_EQ(unsetenv("PDSERVE_SCHED_BACKFILL"), 0);
    PD_CHECK_EQ(pd_env_switch("PDSERVE_SCHED_BACKFILL", true, &v, NULL), PD_OK);
    PD_CHECK(v);
    // pd_env_int, the integer form (the CUDA backend's knobs)
    int n = -1;
    PD_CHECK_EQ(pd_env_int("PD_TEST_KNOB", 7, 0, 100, &n, NULL), PD_OK);
    PD_CHECK_EQ(n, 7);
    PD_CHECK_EQ(setenv("PD_TEST_KNOB", "12", 1), 0);
    PD_CHECK_EQ(pd_env_int("PD_TEST_KNOB", 7, 0, 100, &n, NULL), PD_OK);
    PD_CHECK_EQ(n, 12);
    const char *bad[] = {"x", "12x", "200", "-1", "99999999999999999999"};
    for (int i = 0; i < 5; i++) {
        PD_CHECK_EQ(setenv("PD_TEST_KNOB", bad[i], 1), 0);
        PD_CHECK_EQ(pd_env_int("PD_TEST_KNOB", 7, 0, 100, &n, &err), PD_ERR_INVALID);
        PD_CHECK_CONTAINS(err.msg, "expected an integer in [0, 100]");
    }
    PD_CHECK_EQ(unsetenv("PD_TEST_KNOB"), 0);
}

PD_TEST(engine_rejects_bad_requests) {
    pd_err err = {0};
    pd_engine *e = small_engine(&err);
    PD_REQUIRE(e);
    int32_t prompt[4] = {1, 2, 3, 99999};
    pd_engine_request q = {.id = 1, .prompt = prompt, .n_prompt = 4, .max_tokens = 4, .sampling = pd_sampling_params_default()};
    PD_CHECK_EQ(pd_engine_submit(e, &q, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "token id 99999 at position 3 is out of range");
    prompt[3] = 4;
    q.max_tokens = 5000;
    PD_CHECK_EQ(pd_engine_submit(e, &q, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "maximum context length is 2048 tokens");
    q.max_tokens = 4;
    q.sampling.temperature = -1;
    PD_CHECK_EQ(pd_engine_submit(e, &q, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "temperature");
    pd_engine_free(e);
}
