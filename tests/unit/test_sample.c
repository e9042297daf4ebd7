// Sampler: greedy ties, seeded reproducibility, top-k / top-p / min-p truncation, penalties and
// logprobs, each checked against hand-computed expectations; the counter-based uniform (against
// an independent implementation of its formula), the id-order draw the device op shares, and the
// export / import of a sampler's state for device sampling (pd_op_sample).
#include "model/sample.h"
#include "test.h"

#define V 8

static int draw_counts(pd_sampling_params p, const float *logits, int n_draws, int *counts) {
    pd_sampler *s = pd_sampler_new(&p, V);
    float l[V];
    for (int i = 0; i < V; i++) counts[i] = 0;
    for (int d = 0; d < n_draws; d++) {
        memcpy(l, logits, sizeof l);
        counts[pd_sampler_sample(s, l, NULL)]++;
    }
    pd_sampler_free(s);
    int distinct = 0;
    for (int i = 0; i < V; i++) distinct += counts[i] > 0;
    return distinct;
}

static const float L[V] = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f, 0.0f, 2.5f, 1.5f};  // order: 3, 6, 0, 7, 1, 2, 5, 4

PD_TEST(greedy_and_ties) {
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0;
    pd_sampler *s = pd_sampler_new(&p, V);
    float l[V];
    memcpy(l, L, sizeof l);
    PD_CHECK_EQ(pd_sampler_sample(s, l, NULL), 3);
    float t[V] = {1, 5, 5, 0, 0, 0, 0, 0};
    PD_CHECK_EQ(pd_sampler_sample(s, t, NULL), 1);  // lowest id wins a tie, as torch.argmax
    pd_sampler_free(s);
}

PD_TEST(seeded_is_reproducible) {
    pd_sampling_params p = pd_sampling_params_default();
    p.seed = 42;
    p.has_seed = true;
    int a[64], b[64];
    for (int run = 0; run < 2; run++) {
        pd_sampler *s = pd_sampler_new(&p, V);
        for (int i = 0; i < 64; i++) {
            float l[V];
            memcpy(l, L, sizeof l);
            (run ? b : a)[i] = pd_sampler_sample(s, l, NULL);
        }
        pd_sampler_free(s);
    }
    PD_CHECK(!memcmp(a, b, sizeof a));
    int c[V];
    PD_CHECK(draw_counts(p, L, 2000, c) >= 6);  // temperature 1 really samples
}

PD_TEST(top_k_top_p_min_p_truncate) {
    int c[V];
    pd_sampling_params p = pd_sampling_params_default();
    p.seed = 1, p.has_seed = true;
    p.top_k = 2;
    PD_CHECK_EQ(draw_counts(p, L, 2000, c), 2);
    PD_CHECK(c[3] > 0 && c[6] > 0);
    // top_p: softmax of L; p(3) = 0.391, p(6) = 0.237, p(0) = 0.144: 0.5 keeps {3, 6}
    p = pd_sampling_params_default();
    p.seed = 2, p.has_seed = true;
    p.top_p = 0.5f;
    PD_CHECK_EQ(draw_counts(p, L, 2000, c), 2);
    PD_CHECK(c[3] > c[6] && c[6] > 0);
    // min_p 0.5: keep tokens with p >= 0.5 * p_max, i.e. logit >= 3 - ln 2 = 2.307: {3, 6}
    p = pd_sampling_params_default();
    p.seed = 3, p.has_seed = true;
    p.min_p = 0.5f;
    PD_CHECK_EQ(draw_counts(p, L, 2000, c), 2);
    // the kept tokens keep their relative odds: p(3)/p(6) = e^0.5 = 1.65
    double ratio = (double)c[3] / c[6];
    PD_CHECK_MSG(ratio > 1.4 && ratio < 1.95, "ratio %g", ratio);
}

PD_TEST(penalties) {
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0;
    p.presence_penalty = 1.2f;  // 3 drops below 6 (3.0 - 1.2 = 1.8 < 2.5)
    pd_sampler *s = pd_sampler_new(&p, V);
    pd_sampler_accept(s, 3);
    float l[V];
    memcpy(l, L, sizeof l);
    PD_CHECK_EQ(pd_sampler_sample(s, l, NULL), 6);
    pd_sampler_free(s);
    p = pd_sampling_params_default();
    p.temperature = 0;
    p.frequency_penalty = 0.3f;  // 3 seen twice: 3.0 - 0.6 = 2.4 < 2.5
    s = pd_sampler_new(&p, V);
    pd_sampler_accept(s, 3);
    pd_sampler_accept(s, 3);
    memcpy(l, L, sizeof l);
    PD_CHECK_EQ(pd_sampler_sample(s, l, NULL), 6);
    pd_sampler_free(s);
    p = pd_sampling_params_default();
    p.temperature = 0;
    p.repetition_penalty = 1.5f;  // prompt token 3: 3.0 / 1.5 = 2.0 < 2.5; negative logits are multiplied
    s = pd_sampler_new(&p, V);
    int32_t prompt[2] = {3, 4};
    pd_sampler_add_prompt(s, prompt, 2);
    memcpy(l, L, sizeof l);
    PD_CHECK_EQ(pd_sampler_sample(s, l, NULL), 6);
    PD_CHECK_NEAR(l[4], -1.5, 1e-6);
    pd_sampler_free(s);
}

PD_TEST(logprobs_of_raw_distribution) {
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0;
    p.n_logprobs = 3;
    p.presence_penalty = 2.0f;  // processing must not change the reported logprobs
    pd_sampler *s = pd_sampler_new(&p, V);
    pd_sampler_accept(s, 3);
    float l[V];
    memcpy(l, L, sizeof l);
    pd_sample_result r;
    int32_t t = pd_sampler_sample(s, l, &r);
    double lse = 0;
    for (int i = 0; i < V; i++) lse += exp(L[i]);
    lse = log(lse);
    PD_CHECK_EQ(t, 6);
    PD_CHECK_NEAR(r.logprob, L[6] - lse, 1e-5);
    PD_CHECK_EQ(r.n_top, 3);
    PD_CHECK_EQ(r.top_ids[0], 3);
    PD_CHECK_EQ(r.top_ids[1], 6);
    PD_CHECK_EQ(r.top_ids[2], 0);
    PD_CHECK_NEAR(r.top_logprobs[0], L[3] - lse, 1e-5);
    pd_sampler_free(s);
}

PD_TEST(params_validated) {
    pd_sampling_params p = pd_sampling_params_default();
    pd_err err = {0};
    p.top_p = 0;
    PD_CHECK_EQ(pd_sampling_params_validate(&p, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "top_p");
    p = pd_sampling_params_default();
    p.n_logprobs = 21;
    PD_CHECK_EQ(pd_sampling_params_validate(&p, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "logprobs");
    p = pd_sampling_params_default();
    p.presence_penalty = 3;
    PD_CHECK_EQ(pd_sampling_params_validate(&p, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "presence_penalty");
}

// ---- counter-based draws and device-sampling packing --------------------------------------------

static uint64_t ref_mix(uint64_t z) {  // splitmix64's finaliser, written out again
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double ref_uniform(uint64_t seed, uint64_t n) {
    uint64_t h = ref_mix(seed ^ ref_mix(n * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull));
    return (double)(h >> 11) / 9007199254740992.0;
}

PD_TEST(uniform_is_counter_based) {
    uint64_t seeds[] = {0, 1, 42, 0xffffffffffffffffull};
    double sum = 0, sum2 = 0;
    int buckets[10] = {0}, n = 0, same_neighbour = 0;
    for (size_t k = 0; k < PD_ARRAY_LEN(seeds); k++)
        for (uint64_t i = 0; i < 25000; i++) {
            double u = pd_sample_uniform(seeds[k], i);
            PD_CHECK_MSG(u == ref_uniform(seeds[k], i), "seed %llu draw %llu", (unsigned long long)seeds[k],
                         (unsigned long long)i);
            if (!(u >= 0 && u < 1)) PD_FAIL_("u = %g out of [0, 1)", u);
            same_neighbour += u == pd_sample_uniform(seeds[k], i + 1) || u == pd_sample_uniform(seeds[k] + 1, i);
            sum += u, sum2 += u * u, n++;
            buckets[(int)(u * 10)]++;
        }
    PD_CHECK_EQ(same_neighbour, 0);
    PD_CHECK_NEAR(sum / n, 0.5, 0.005);
    PD_CHECK_NEAR(sum2 / n - (sum / n) * (sum / n), 1.0 / 12, 0.002);
    for (int b = 0; b < 10; b++) PD_CHECK_MSG(abs(buckets[b] - n / 10) < n / 100, "bucket %d: %d of %d", b, buckets[b], n);
}

// The token a draw must give: the first id (in id order among the survivors) whose running mass
// exceeds u * total, with u = pd_sample_uniform(seed, draw index).
static int ref_draw(const float *l, const bool *keep, uint64_t seed, uint64_t n) {
    double mx = -INFINITY, sum = 0, acc = 0;
    for (int i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
    for (int i = 0; i < V; i++) sum += keep[i] ? expf(l[i] - (float)mx) : 0;
    double r = ref_uniform(seed, n) * sum;
    int last = -1;
    for (int i = 0; i < V; i++) {
        if (!keep[i]) continue;
        acc += expf(l[i] - (float)mx);
        last = i;
        if (r < acc) return i;
    }
    return last;
}

PD_TEST(draws_walk_survivors_in_id_order) {
    bool all[V], top3[V] = {0};
    for (int i = 0; i < V; i++) all[i] = true;
    top3[3] = top3[6] = top3[0] = true;  // L's three largest
    for (int c = 0; c < 2; c++) {
        pd_sampling_params p = pd_sampling_params_default();
        p.seed = 1234 + (uint64_t)c, p.has_seed = true;
        p.top_k = c ? 3 : 0;
        pd_sampler *s = pd_sampler_new(&p, V);
        int distinct[V] = {0};
        for (uint64_t d = 0; d < 300; d++) {
            PD_CHECK_EQ(pd_sampler_n_draws(s), d);
            float l[V];
            memcpy(l, L, sizeof l);
            int32_t t = pd_sampler_sample(s, l, NULL);
            PD_CHECK_EQ(t, ref_draw(L, c ? top3 : all, p.seed, d));
            distinct[t] = 1;
        }
        int nd = 0;
        for (int i = 0; i < V; i++) nd += distinct[i];
        PD_CHECK_EQ(nd, c ? 3 : V);
        pd_sampler_free(s);
    }
    // greedy consumes no draw
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0;
    pd_sampler *s = pd_sampler_new(&p, V);
    float l[V];
    memcpy(l, L, sizeof l);
    pd_sampler_sample(s, l, NULL);
    PD_CHECK_EQ(pd_sampler_n_draws(s), 0);
    pd_sampler_free(s);
}

static const pd_sample_pen *find_pen(const pd_sample_pen *pens, int n, int32_t t) {
    for (int i = 0; i < n; i++)
        if (pens[i].token == t) return &pens[i];
    return NULL;
}

PD_TEST(export_row_packs_params_and_penalties) {
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0.7f, p.top_k = 5, p.top_p = 0.9f, p.min_p = 0.05f, p.n_logprobs = 2;
    p.repetition_penalty = 1.3f, p.presence_penalty = 0.5f, p.frequency_penalty = 0.25f;
    p.seed = 99, p.has_seed = true;
    pd_sampler *s = pd_sampler_new(&p, V);
    int32_t prompt[] = {3, 4, 4, 1};
    pd_sampler_add_prompt(s, prompt, 4);
    pd_sampler_accept(s, 3);
    pd_sampler_accept(s, 3);
    pd_sampler_accept(s, 5);
    PD_CHECK_EQ(pd_sampler_n_pens(s), 4);  // seen {3, 4, 1, 5}, one entry each
    pd_sample_pen pens[8];
    pd_sample_row row;
    pd_sampler_export_row(s, 7, &row, pens);
    PD_CHECK_EQ(row.n_pens, 4);
    PD_CHECK_EQ(row.pen_begin, 7);
    PD_CHECK(row.temperature == 0.7f && row.top_k == 5 && row.top_p == 0.9f && row.min_p == 0.05f);
    PD_CHECK(row.repetition_penalty == 1.3f && row.presence_penalty == 0.5f && row.frequency_penalty == 0.25f);
    PD_CHECK_EQ(row.seed, 99);
    PD_CHECK_EQ(row.draw_idx, 0);
    PD_CHECK_EQ(row.n_logprobs, 2);
    int want_count[V] = {[3] = 2, [5] = 1};
    int32_t seen[] = {3, 4, 1, 5};
    for (int i = 0; i < 4; i++) {
        const pd_sample_pen *e = find_pen(pens, 4, seen[i]);
        PD_CHECK_MSG(e && e->is_seen && e->count == want_count[seen[i]], "entry for token %d", seen[i]);
    }
    // The device result comes back as a pd_sample_result and consumes the draw.
    pd_sample_out o = {.token = 6, .logprob = -1.5f, .n_top = 2, .top_ids = {3, 6}, .top_logprobs = {-0.9f, -1.5f}};
    pd_sample_result r;
    PD_CHECK_EQ(pd_sampler_import_result(s, &o, &r), 6);
    PD_CHECK_EQ(r.token, 6);
    PD_CHECK(r.logprob == -1.5f && r.n_top == 2 && r.top_ids[1] == 6 && r.top_logprobs[0] == -0.9f);
    PD_CHECK_EQ(pd_sampler_n_draws(s), 1);
    pd_sampler_accept(s, 6);
    pd_sampler_export_row(s, 0, &row, pens);
    PD_CHECK_EQ(row.draw_idx, 1);
    PD_CHECK_EQ(row.n_pens, 5);
    pd_sampler_free(s);

    // Presence / frequency only: the generated tokens, not the prompt, and not marked seen.
    p = pd_sampling_params_default();
    p.temperature = 0, p.frequency_penalty = 1.0f;
    s = pd_sampler_new(&p, V);
    pd_sampler_add_prompt(s, prompt, 4);
    pd_sampler_accept(s, 2);
    pd_sampler_accept(s, 7);
    pd_sampler_accept(s, 2);
    PD_CHECK_EQ(pd_sampler_n_pens(s), 2);
    pd_sampler_export_row(s, 0, &row, pens);
    const pd_sample_pen *e2 = find_pen(pens, 2, 2), *e7 = find_pen(pens, 2, 7);
    PD_CHECK(e2 && e2->count == 2 && !e2->is_seen && e7 && e7->count == 1);
    PD_CHECK(row.temperature == 0.0f);
    o = (pd_sample_out){.token = 2};
    pd_sampler_import_result(s, &o, NULL);
    PD_CHECK_EQ(pd_sampler_n_draws(s), 0);  // greedy draws nothing
    pd_sampler_free(s);

    // No penalty: no entries.
    p = pd_sampling_params_default();
    s = pd_sampler_new(&p, V);
    pd_sampler_add_prompt(s, prompt, 4);
    pd_sampler_accept(s, 2);
    PD_CHECK_EQ(pd_sampler_n_pens(s), 0);
    pd_sampler_free(s);
}

// ---- logit bias and token masks (pd_sample_ctl) ----------------------------------------------------

typedef struct only_evens {
    int vocab, n_accepted;
} only_evens;
static int evens_fill(void *ud, uint32_t *m) {
    only_evens *o = ud;
    memset(m, 0, sizeof(uint32_t) * (size_t)((o->vocab + 31) / 32));
    for (int t = 0; t < o->vocab; t += 2) m[t >> 5] |= 1u << (t & 31);
    return (o->vocab + 1) / 2;
}
static pd_status evens_accept(void *ud, int32_t t) {
    only_evens *o = ud;
    o->n_accepted++;
    return t % 2 ? PD_ERR_INVALID : PD_OK;
}
static int g_evens_freed;
static void evens_free(void *ud) {
    g_evens_freed++;
    pd_free(ud);
}
static const pd_token_mask_ops k_evens = {evens_fill, evens_accept, evens_free};

#define NV 100
PD_TEST(logit_bias_and_mask) {
    float logits[NV], work[NV];
    for (int i = 0; i < NV; i++) logits[i] = (float)(i % 17) * 0.1f;
    logits[41] = 50.0f;  // the greedy choice
    logits[43] = 40.0f;
    logits[44] = 30.0f;
    pd_sampling_params p = pd_sampling_params_default();
    p.temperature = 0;
    p.n_logprobs = 1;

    // -100 bans 41 (whatever its logit); +100 on a low token makes it win.
    pd_sampler *s = pd_sampler_new(&p, NV);
    pd_sample_ctl *c = pd_calloc(1, sizeof *c);
    c->bias = pd_malloc(sizeof(pd_logit_bias) * 2);
    c->bias[c->n_bias++] = (pd_logit_bias){41, -100.0f};
    c->bias[c->n_bias++] = (pd_logit_bias){3, 2.0f};
    PD_REQUIRE(pd_sampler_set_ctl(s, c) == PD_OK);
    memcpy(work, logits, sizeof work);
    pd_sample_result r;
    PD_CHECK_EQ(pd_sampler_sample(s, work, &r), 43);
    PD_CHECK_NEAR(r.logprob, -10.0f, 1e-3);  // raw distribution: 43 is 10 below 41
    PD_CHECK(!pd_sampler_has_mask(s));
    pd_sample_pen pens[4];
    pd_sample_row row;
    PD_CHECK_EQ(pd_sampler_n_pens(s), 2);  // bias entries ride on the penalty array
    pd_sampler_export_row(s, 0, &row, pens);
    PD_CHECK(row.n_pens == 2 && row.mask_row == -1 && pens[0].token == 41 && pens[0].bias == -100.0f);

    // Random draws never pick a banned token, even a likely one.
    pd_sampler_free(s);
    p.temperature = 1.0f, p.has_seed = true, p.seed = 5;
    s = pd_sampler_new(&p, NV);
    c = pd_calloc(1, sizeof *c);
    c->bias = pd_malloc(sizeof(pd_logit_bias));
    c->bias[c->n_bias++] = (pd_logit_bias){41, -100.0f};
    PD_REQUIRE(pd_sampler_set_ctl(s, c) == PD_OK);
    for (int i = 0; i < 200; i++) {
        memcpy(work, logits, sizeof work);
        PD_CHECK(pd_sampler_sample(s, work, NULL) != 41);
    }
    pd_sampler_free(s);

    // A mask: only even tokens; the source sees every accepted token and is freed with the sampler.
    p.temperature = 0;
    s = pd_sampler_new(&p, NV);
    c = pd_calloc(1, sizeof *c);
    only_evens *o = pd_calloc(1, sizeof *o);
    o->vocab = NV;
    c->mask_ops = &k_evens;
    c->mask_ud = o;
    PD_REQUIRE(pd_sampler_set_ctl(s, c) == PD_OK);
    PD_CHECK(pd_sampler_has_mask(s));
    memcpy(work, logits, sizeof work);
    int32_t t = pd_sampler_sample(s, work, NULL);
    PD_CHECK_EQ(t, 44);
    pd_sampler_accept(s, t);
    PD_CHECK_EQ(o->n_accepted, 1);
    uint32_t m[4];
    pd_sampler_fill_mask(s, m);
    PD_CHECK(m[0] == 0x55555555u);
    g_evens_freed = 0;
    pd_sampler_free(s);
    PD_CHECK_EQ(g_evens_freed, 1);
}
