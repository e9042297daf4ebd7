// Speculative decoding through the engine (CPU) on every golden model and prompt: greedy output
// with speculation on — draft model, n-gram prompt lookup, lookahead — must be byte-identical to
// speculation off, and match the golden continuations (up to a near-tie), alone and 6 copies at a
// time, with prefix caching on and off, small token budgets (chunked prefill) and a KV pool small
// enough to preempt. The draft for kjv-llama-6m is kjv-llama-1m (the pair of the golden file's
// "speculative_acceptance"); the random models draft for themselves (the same weights: every
// draft must be accepted, which checks the draft path's positions and KV end to end).
// Also reports the kjv pair's acceptance rate and mean accepted length on the golden prompts.
#include <jansson.h>
#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/engine.h"
#include "spec/spec.h"
#include "test.h"

static const char *MODELS[] = {"kjv-llama-6m", "kjv-llama-1m", "tiny-random-llama31", "tiny-random-qwen2"};

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
    int spec_drafted[MAXR], spec_accepted[MAXR], spec_steps[MAXR];
} run;

static pd_engine_stats run_engine(const char *model, const pd_engine_params *p0, run *r) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", pd_test_models_dir(), model);
    pd_engine_params p = *p0;
    p.model_dir = dir;
    p.device = "cpu";
    pd_err err = {0};
    pd_engine_stats st = {0};
    pd_engine *e = pd_engine_new(&p, &err);
    if (!e) {
        PD_FAIL_("engine %s: %s", model, err.msg);
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
    int64_t deadline = pd_time_us() + 300 * 1000000LL;
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
                    PD_CHECK_EQ(ev[k].n_output_tokens, r->n_out[i] + 1);
                    if (r->n_out[i] < MAXOUT) r->out[i][r->n_out[i]++] = ev[k].tok.token;
                } else {
                    r->finish[i] = ev[k].finish;
                    r->spec_drafted[i] = ev[k].n_spec_drafted;
                    r->spec_accepted[i] = ev[k].n_spec_accepted;
                    r->spec_steps[i] = ev[k].n_spec_steps;
                    done++;
                }
            }
        }
    }
    PD_CHECK_EQ(done, r->n);
    for (int i = 0; i < 100; i++) {
        pd_engine_stats_get(e, &st);
        if (st.n_running == 0 && st.n_waiting == 0) break;
        poll(NULL, 0, 10);
    }
    pd_engine_free(e);
    return st;
}

static json_t *golden_of(const char *model) {
    char p[512];
    snprintf(p, sizeof p, "%s/golden/%s.json", pd_test_models_dir(), model);
    json_t *g = json_load_file(p, 0, NULL);
    if (!g) PD_FAIL_("cannot read %s", p);
    return g;
}

static void load_prompts(run *r, json_t *g, int copies) {
    json_t *prompts = json_object_get(g, "prompts");
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

// Golden tokens up to the first near-tie (margin < 1e-3), as the engine tests compare.
static void check_golden(const run *r, json_t *g, const char *what) {
    json_t *prompts = json_object_get(g, "prompts");
    size_t np = json_array_size(prompts);
    for (int i = 0; i < r->n; i++) {
        json_t *gr = json_object_get(json_array_get(prompts, (size_t)i % np), "greedy");
        json_t *ids = json_object_get(gr, "new_ids"), *steps = json_object_get(gr, "steps");
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

static void check_same(const run *a, const run *b, const char *what) {
    for (int i = 0; i < a->n; i++) {
        PD_CHECK_MSG(a->n_out[i] == b->n_out[i] && a->finish[i] == b->finish[i], "%s: request %d: %d tokens (finish %d) vs %d (%d)", what,
                     i, b->n_out[i], b->finish[i], a->n_out[i], a->finish[i]);
        for (int k = 0; k < PD_MIN(a->n_out[i], b->n_out[i]); k++)
            if (a->out[i][k] != b->out[i][k]) {
                PD_FAIL_("%s: request %d token %d: %d with speculation, %d without", what, i, k, b->out[i][k], a->out[i][k]);
                break;
            }
    }
}

typedef struct scase {
    bool prefix;
    int budget, copies, n_blocks;
    bool fixed;
    const char *name;
} scase;

static const scase CASES[] = {
    {true, 2048, 1, 512, false, "alone, adaptive"},
    {true, 2048, 1, 512, true, "alone, fixed k"},
    {false, 16, 1, 512, true, "prefix off, budget 16"},
    {true, 2048, 6, 512, false, "36 concurrent"},
    {true, 64, 6, 40, true, "36 concurrent, budget 64, 40 blocks (preemption)"},
};

// Speculation-off reference runs, one per (model, case), shared by the methods (freed at exit).
static run *g_off[PD_ARRAY_LEN(MODELS)][PD_ARRAY_LEN(CASES)];

static run *off_run(const char *model, size_t c, json_t *g, const pd_engine_params *p) {
    size_t mi = 0;
    while (mi < PD_ARRAY_LEN(MODELS) && strcmp(MODELS[mi], model)) mi++;
    PD_ASSERT(mi < PD_ARRAY_LEN(MODELS));
    if (!g_off[mi][c]) {
        run *r = calloc(1, sizeof *r);  // outlives the test (the leak check counts pd_malloc)
        PD_ASSERT(r);
        load_prompts(r, g, CASES[c].copies);
        run_engine(model, p, r);
        for (int i = 0; i < r->n; i++) {  // keep only the outputs: prompts go back now
            pd_free(r->prompts[i]);
            r->prompts[i] = NULL;
        }
        g_off[mi][c] = r;
    }
    return g_off[mi][c];
}

// cases: a bit per CASES entry. ALL_CASES on the kjv pair; elsewhere the cases that change the step
// structure most (SOME_CASES: fixed k alone, chunked prefill without prefix caching, preemption).
#define ALL_CASES 0x1fu
#define SOME_CASES (ALL_CASES & ~(1u | 8u))
#define ADAPTIVE_CASES (1u | 8u)
static void check_method(const char *model, pd_spec_method m, const char *draft, int k, unsigned cases) {
    json_t *g = golden_of(model);
    if (!g) return;
    char draft_dir[512];
    if (draft) snprintf(draft_dir, sizeof draft_dir, "%s/%s", pd_test_models_dir(), draft);
    int64_t drafted = 0, accepted = 0;
    for (size_t c = 0; c < PD_ARRAY_LEN(CASES) && !pd_test_failed_; c++) {
        const scase *sc = &CASES[c];
        if (!(cases & 1u << c)) continue;
        run *on = pd_calloc(1, sizeof *on);
        load_prompts(on, g, sc->copies);
        pd_engine_params p = pd_engine_params_default();
        p.enable_prefix_caching = sc->prefix;
        p.max_num_batched_tokens = sc->budget;
        p.n_blocks = sc->n_blocks;
        run *off = off_run(model, c, g, &p);
        p.spec_method = m;
        p.spec_model_dir = draft ? draft_dir : NULL;
        p.spec_k = k;
        p.spec_fixed = sc->fixed;
        pd_engine_stats st = run_engine(model, &p, on);
        char what[256];
        snprintf(what, sizeof what, "%s %s (%s)", model, pd_spec_method_name(m), sc->name);
        check_same(off, on, what);
        check_golden(on, g, what);
        PD_CHECK_EQ(st.n_blocks_used, 0);
        PD_CHECK_EQ(st.spec_method, m);
        // Fixed lengths must draft; the adaptive policy may rightly choose not to on a CPU, where a
        // forward costs about its tokens (lookahead's window is then off and its pool stays empty).
        PD_CHECK_MSG(!sc->fixed || st.spec_drafted[m] > 0, "%s: nothing was drafted", what);
        PD_CHECK(st.spec_accepted[m] <= st.spec_drafted[m]);
        PD_CHECK_EQ(st.spec_emitted[m], st.spec_accepted[m] + st.spec_steps[m]);
        int64_t sum_d = 0, sum_a = 0;
        for (int i = 0; i < on->n; i++) sum_d += on->spec_drafted[i], sum_a += on->spec_accepted[i];
        PD_CHECK_EQ(sum_d, st.spec_drafted[m]);  // per request (usage) adds up to the totals
        PD_CHECK_EQ(sum_a, st.spec_accepted[m]);
        drafted += st.spec_drafted[m];
        accepted += st.spec_accepted[m];
        printf("  %s: drafted %lld, accepted %lld (%.3f), mean accepted length %.2f\n", what, (long long)st.spec_drafted[m],
               (long long)st.spec_accepted[m], st.spec_drafted[m] ? (double)st.spec_accepted[m] / (double)st.spec_drafted[m] : 0,
               st.spec_steps[m] ? (double)st.spec_emitted[m] / (double)st.spec_steps[m] : 0);
        free_prompts(on);
        pd_free(on);
    }
    if (draft && !strcmp(draft, model)) PD_CHECK_EQ(accepted, drafted);  // self-drafting accepts all
    json_decref(g);
}

PD_TEST(spec_draft_kjv_pair) { check_method("kjv-llama-6m", PD_SPEC_DRAFT, "kjv-llama-1m", 4, ALL_CASES); }
PD_TEST(spec_draft_self_random_models) {
    check_method("tiny-random-llama31", PD_SPEC_DRAFT, "tiny-random-llama31", 3, SOME_CASES);
    check_method("tiny-random-qwen2", PD_SPEC_DRAFT, "tiny-random-qwen2", 5, SOME_CASES);
}
// The adaptive policy where drafting cannot pay: kjv-llama-6m drafting for itself (a draft as dear
// as the target, and on a CPU a verify step costs about its tokens), so the engines run mostly
// plain steps — the draft method's idle fast path, probe steps of every idle sequence, catch-ups
// of the draft's KV after idle stretches. Output identical to speculation off, and every draft that
// ran accepted (the same weights: a catch-up that left the draft's KV wrong would show here).
PD_TEST(spec_draft_adaptive_where_it_cannot_pay) {
    check_method("kjv-llama-6m", PD_SPEC_DRAFT, "kjv-llama-6m", 4, ADAPTIVE_CASES);
}
PD_TEST(spec_ngram_all_models) {
    for (size_t i = 0; i < PD_ARRAY_LEN(MODELS); i++) check_method(MODELS[i], PD_SPEC_NGRAM, NULL, 4, i == 0 ? ALL_CASES : SOME_CASES);
}
PD_TEST(spec_lookahead_all_models) {
    for (size_t i = 0; i < PD_ARRAY_LEN(MODELS); i++) check_method(MODELS[i], PD_SPEC_LOOKAHEAD, NULL, 4, i == 0 ? ALL_CASES : SOME_CASES);
}

// A copy of kjv-llama-1m whose tokenizer maps two ids the other way round (every shared model has
// the same tokenizer): the weights are fine, the ids would mean other text. Returns the folder.
static bool make_mismatched_draft(char *dir, size_t n) {
    snprintf(dir, n, "/tmp/pd-spec-draft-XXXXXX");
    if (!mkdtemp(dir)) return false;
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
                           "special_tokens_map.json"};
    char src[1024], dst[1024];
    for (size_t i = 0; i < PD_ARRAY_LEN(files); i++) {
        snprintf(src, sizeof src, "%s/kjv-llama-1m/%s", pd_test_models_dir(), files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        if (symlink(src, dst)) return false;
    }
    snprintf(src, sizeof src, "%s/kjv-llama-1m/tokenizer.json", pd_test_models_dir());
    json_t *t = json_load_file(src, 0, NULL);
    json_t *vocab = json_object_get(json_object_get(t, "model"), "vocab");
    const char *k;
    json_t *v;
    const char *ka = NULL, *kb = NULL;
    json_object_foreach(vocab, k, v) {
        if (json_integer_value(v) == 300) ka = k;
        if (json_integer_value(v) == 301) kb = k;
    }
    bool ok = ka && kb;
    if (ok) {
        json_object_set_new(vocab, ka, json_integer(301));
        json_object_set_new(vocab, kb, json_integer(300));
        snprintf(dst, sizeof dst, "%s/tokenizer.json", dir);
        ok = json_dump_file(t, dst, 0) == 0;
    }
    json_decref(t);
    return ok;
}

static void remove_draft(const char *dir) {
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
                           "special_tokens_map.json", "tokenizer.json"};
    char p[1024];
    for (size_t i = 0; i < PD_ARRAY_LEN(files); i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

// A draft whose tokenizer differs from the target's is refused with a clear error.
PD_TEST(spec_draft_tokenizer_mismatch_refused) {
    char dir[512], draft[512];
    snprintf(dir, sizeof dir, "%s/kjv-llama-6m", pd_test_models_dir());
    PD_REQUIRE(make_mismatched_draft(draft, sizeof draft));
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = dir;
    p.device = "cpu";
    p.n_blocks = 64;
    p.spec_method = PD_SPEC_DRAFT;
    p.spec_model_dir = draft;
    pd_err err = {0};
    pd_engine *e = pd_engine_new(&p, &err);
    PD_CHECK(!e);
    PD_CHECK_CONTAINS(err.msg, "tokenizer differs");
    PD_CHECK_CONTAINS(err.msg, "must match");
    pd_engine_free(e);
    remove_draft(draft);
    p.spec_model_dir = NULL;  // draft without a model
    memset(&err, 0, sizeof err);
    e = pd_engine_new(&p, &err);
    PD_CHECK(!e);
    PD_CHECK_CONTAINS(err.msg, "--speculative-model");
    pd_engine_free(e);
}

// The kjv pair on the golden file's 20 "speculative_acceptance" prompts (32 held-out tokens, 64
// greedy tokens, all 20 in one batch): acceptance rate and mean accepted length at k = 1 and 4,
// fixed lengths.
// The reference figure there (teacher-forced argmax agreement) is 0.6617; our per-draft acceptance
// must be close to it (greedy: a draft token is accepted iff it equals the target's argmax).
PD_TEST(spec_kjv_pair_acceptance_report) {
    json_t *g = golden_of("kjv-llama-6m");
    if (!g) return;
    json_t *sa = json_object_get(g, "speculative_acceptance"), *pp = json_object_get(sa, "per_prompt");
    char draft_dir[512];
    snprintf(draft_dir, sizeof draft_dir, "%s/kjv-llama-1m", pd_test_models_dir());
    int ks[] = {1, 4};
    for (size_t ki = 0; ki < PD_ARRAY_LEN(ks); ki++) {
        run *r = pd_calloc(1, sizeof *r);
        r->n = (int)json_array_size(pp);
        for (int i = 0; i < r->n; i++) {
            json_t *ids = json_object_get(json_array_get(pp, (size_t)i), "prompt_ids");
            r->n_prompt[i] = (int)json_array_size(ids);
            r->prompts[i] = pd_malloc(sizeof(int32_t) * (size_t)r->n_prompt[i]);
            for (int j = 0; j < r->n_prompt[i]; j++) r->prompts[i][j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
        }
        r->max_tokens = 64;
        pd_engine_params p = pd_engine_params_default();
        p.n_blocks = 512;
        p.spec_method = PD_SPEC_DRAFT;
        p.spec_model_dir = draft_dir;
        p.spec_k = ks[ki];
        p.spec_fixed = true;
        pd_engine_stats st = run_engine("kjv-llama-6m", &p, r);
        int m = PD_SPEC_DRAFT, matched = 0, total = 0;
        for (int i = 0; i < r->n; i++) {
            json_t *want = json_object_get(json_array_get(pp, (size_t)i), "target_greedy_ids");
            for (int k = 0; k < r->n_out[i]; k++, total++) matched += r->out[i][k] == (int)json_integer_value(json_array_get(want, (size_t)k));
        }
        double acc = (double)st.spec_accepted[m] / (double)PD_MAX(st.spec_drafted[m], 1);
        double mal = (double)st.spec_emitted[m] / (double)PD_MAX(st.spec_steps[m], 1);
        printf("  kjv-llama-1m -> kjv-llama-6m, k=%d: 20 prompts x 64 tokens: drafted %lld, accepted %lld, acceptance %.4f, "
               "mean accepted length %.3f tokens/verify step (target tokens match golden: %d/%d)\n",
               ks[ki], (long long)st.spec_drafted[m], (long long)st.spec_accepted[m], acc, mal, matched, total);
        PD_CHECK(matched >= total * 95 / 100);  // fp32 CPU vs transformers fp32: near-ties only
        if (ks[ki] == 1) PD_CHECK_MSG(fabs(acc - 0.6617) < 0.05, "k=1 acceptance %.4f vs the reference 0.6617", acc);
        PD_CHECK(mal > 1.0);
        free_prompts(r);
        pd_free(r);
    }
    json_decref(g);
}
