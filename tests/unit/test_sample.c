// Sampler: greedy ties, seeded reproducibility, top-k / top-p / min-p truncation, penalties and
// logprobs, each checked against hand-computed expectations.
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
