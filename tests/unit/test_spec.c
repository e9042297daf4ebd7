// Speculative decoding's pure parts (spec/spec.h) and the acceptance rule (model/sample.h):
//   * n-gram prompt lookup, the lookahead pool and Jacobi window, the acceptance estimate, the
//     step-cost model and the length choice (it must switch speculation off when steps cost in
//     proportion to their tokens, and use it when they are flat);
//   * the rejection sampler: over many seeds, the first token of speculative sampling (draft
//     distribution q, acceptance rule, residual) follows the target's distribution p as plain
//     sampling does (chi-square), for draft-model and draft-free proposals, with temperature,
//     top-k, top-p and penalties; and the test catches a deliberately broken rule.
#include <math.h>

#include "model/sample.h"
#include "spec/spec.h"
#include "test.h"

PD_TEST(ngram_lookup) {
    int32_t t[] = {5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7};
    int32_t out[8];
    // Last 3 tokens (5 6 7): most recent earlier match at 5, followed by 1 2 5 6.
    PD_CHECK_EQ(pd_spec_ngram_propose(t, 13, 1, 3, 4, out), 4);
    PD_CHECK(out[0] == 1 && out[1] == 2 && out[2] == 5 && out[3] == 6);
    // k larger than what follows: the loop (4 3) goes on periodically.
    int32_t u[] = {3, 4, 3};
    PD_CHECK_EQ(pd_spec_ngram_propose(u, 3, 1, 2, 5, out), 5);
    PD_CHECK(out[0] == 4 && out[1] == 3 && out[2] == 4 && out[3] == 3 && out[4] == 4);
    // A loop of period 1 (7 7 7): k copies of 7.
    int32_t c1[] = {1, 7, 7, 7};
    PD_CHECK_EQ(pd_spec_ngram_propose(c1, 4, 1, 3, 6, out), 6);
    for (int j = 0; j < 6; j++) PD_CHECK_EQ(out[j], 7);
    // Period 3 matched by a 3-gram: 1 2 3 1 2 3 -> 1 2 3 1 2 3 1.
    int32_t c3[] = {9, 1, 2, 3, 1, 2, 3};
    PD_CHECK_EQ(pd_spec_ngram_propose(c3, 7, 1, 3, 7, out), 7);
    for (int j = 0; j < 7; j++) PD_CHECK_EQ(out[j], 1 + j % 3);
    // Keeping the alignment across a substitution: history 5 6 7 8 9 | 5 6 X: the suffix (6 X),
    // (X) matches nothing; with the hint (the position after the source's 7) the copy goes on: 8 9.
    int32_t sub[] = {5, 6, 7, 8, 9, 5, 6, 42};
    int src = 0;
    PD_CHECK_EQ(pd_spec_ngram_propose_at(sub, 8, 1, 3, 2, -1, out, &src), 0);
    PD_CHECK_EQ(src, -1);
    PD_CHECK_EQ(pd_spec_ngram_propose_at(sub, 8, 1, 3, 2, 3, out, &src), 2);
    PD_CHECK(out[0] == 8 && out[1] == 9 && src == 3);
    PD_CHECK_EQ(pd_spec_ngram_propose_at(sub, 8, 1, 3, 2, 8, out, &src), 0);  // a hint past the history: nothing
    PD_CHECK_EQ(pd_spec_ngram_propose_at(sub, 8, 1, 3, 2, 0, out, &src), 0);
    // A match wins over the hint, and src says where it was copied from.
    PD_CHECK_EQ(pd_spec_ngram_propose_at(t, 13, 1, 3, 4, 2, out, &src), 4);
    PD_CHECK(out[0] == 1 && src == 8);
    int32_t v[] = {1, 2, 3, 4};
    PD_CHECK_EQ(pd_spec_ngram_propose(v, 4, 1, 3, 4, out), 0);  // no repetition: nothing
    PD_CHECK_EQ(pd_spec_ngram_propose(v, 1, 1, 3, 4, out), 0);
    PD_CHECK_EQ(pd_spec_ngram_propose(t, 13, 1, 3, 0, out), 0);
    // min length respected: 2-gram (9 9) absent, 1-gram would match but min is 2.
    int32_t w[] = {9, 1, 9};
    PD_CHECK_EQ(pd_spec_ngram_propose(w, 3, 2, 3, 2, out), 0);
    PD_CHECK_EQ(pd_spec_ngram_propose(w, 3, 1, 3, 2, out), 2);
}

PD_TEST(lookahead_pool_and_jacobi) {
    pd_spec_pool *p = pd_spec_pool_new(3);
    PD_REQUIRE(p);
    int32_t out[4];
    PD_CHECK_EQ(pd_spec_pool_propose(p, 7, 2, out), 0);
    int32_t g1[] = {7, 1, 2}, g2[] = {7, 3, 4};
    pd_spec_pool_add(p, g1);
    pd_spec_pool_add(p, g2);
    PD_CHECK_EQ(pd_spec_pool_size(p), 2);
    PD_CHECK_EQ(pd_spec_pool_propose(p, 7, 5, out), 2);  // newest first
    PD_CHECK(out[0] == 3 && out[1] == 4);
    pd_spec_pool_add(p, g1);  // a duplicate moves to the front, not in twice
    PD_CHECK_EQ(pd_spec_pool_size(p), 2);
    PD_CHECK_EQ(pd_spec_pool_propose(p, 7, 1, out), 1);
    PD_CHECK_EQ(out[0], 1);
    // Many keys: the table evicts, never grows past its slots, never crashes.
    for (int32_t k = 0; k < 100000; k++) {
        int32_t g[] = {k, k + 1, k + 2};
        pd_spec_pool_add(p, g);
    }
    PD_CHECK(pd_spec_pool_size(p) <= 1024 * 4);
    PD_CHECK_EQ(pd_spec_pool_propose(p, 99999, 2, out), 2);
    PD_CHECK(out[0] == 100000 && out[1] == 100001);
    pd_spec_pool_free(p);

    // Jacobi on a "model" whose next token is prev + 1: after N - 1 iterations the diagonals are
    // exact n-grams (t, t+1, t+2) of the model, and the pool proposes the model's continuation.
    pd_spec_pool *pool = pd_spec_pool_new(3);
    pd_spec_jacobi j;
    int32_t ctx[] = {50, 60, 70, 80};
    pd_spec_jacobi_init(&j, 5, 3, ctx, 4);
    int32_t last = 10;
    for (int it = 0; it < 6; it++) {
        const int32_t *win = pd_spec_jacobi_window(&j);
        int32_t pred[5];
        pred[0] = last + 1;
        for (int i = 1; i < 5; i++) pred[i] = win[i - 1] + 1;
        pd_spec_jacobi_step(&j, pred, pool);
    }
    const int32_t *win = pd_spec_jacobi_window(&j);
    for (int i = 0; i < 5; i++) PD_CHECK_EQ(win[i], 11 + i);  // converged: the fixed point
    PD_CHECK_EQ(pd_spec_pool_propose(pool, 12, 2, out), 2);
    PD_CHECK(out[0] == 13 && out[1] == 14);
    pd_spec_pool_free(pool);
}

PD_TEST(acceptance_estimate) {
    pd_spec_accept a;
    pd_spec_accept_init(&a, 0.5);
    PD_CHECK_NEAR(pd_spec_accept_alpha(&a), 0.5, 1e-12);
    for (int i = 0; i < 100; i++) pd_spec_accept_update(&a, 4, 4);  // always all accepted
    PD_CHECK(pd_spec_accept_alpha(&a) > 0.99);
    for (int i = 0; i < 100; i++) pd_spec_accept_update(&a, 4, 0);  // always rejected at once
    PD_CHECK(pd_spec_accept_alpha(&a) < 0.02);
    for (int i = 0; i < 200; i++) pd_spec_accept_update(&a, 4, i % 2 ? 3 : 4);  // 7 of 8, one failure per 2
    PD_CHECK_NEAR(pd_spec_accept_alpha(&a), 7.0 / 8.0, 0.02);
    pd_spec_accept_update(&a, 0, 0);  // nothing drafted: no information
}

// Independent tokens at a steady alpha: the runs of rejections they produce do not move the
// estimate far (the long memory; before, a 10-step memory dropped to ~0.45 after such runs and
// the policy drafted k = 2), while a real change is followed within ~20 verify steps.
static int geometric_accepts(pd_rng *r, double alpha, int k) {
    int n = 0;
    while (n < k && (double)(pd_rng_next(r) >> 11) * 0x1.0p-53 < alpha) n++;
    return n;
}

PD_TEST(acceptance_estimate_steady_and_change) {
    pd_rng r;
    pd_rng_seed(&r, 7);
    pd_spec_accept a;
    pd_spec_accept_init(&a, 0.7);
    int low = 0, n = 0;
    double lo = 1, hi = 0;
    for (int i = 0; i < 3000; i++) {
        pd_spec_accept_update(&a, 4, geometric_accepts(&r, 0.7, 4));
        if (i < 50) continue;
        double al = pd_spec_accept_alpha(&a);
        lo = al < lo ? al : lo, hi = al > hi ? al : hi;
        low += al < 0.6, n++;
    }
    PD_CHECK_MSG(lo > 0.55 && hi < 0.85, "steady 0.7: estimate in [%.3f, %.3f]", lo, hi);
    PD_CHECK_MSG(low * 100 < n, "steady 0.7: estimate below 0.6 in %d of %d steps", low, n);
    int steps = 0;  // the rate falls to 0.2: followed
    while (steps < 60 && pd_spec_accept_alpha(&a) > 0.4) pd_spec_accept_update(&a, 4, geometric_accepts(&r, 0.2, 4)), steps++;
    PD_CHECK_MSG(steps <= 25, "0.7 -> 0.2 followed after %d steps", steps);
    steps = 0;  // and back up to 0.9
    while (steps < 60 && pd_spec_accept_alpha(&a) < 0.75) pd_spec_accept_update(&a, 4, geometric_accepts(&r, 0.9, 4)), steps++;
    PD_CHECK_MSG(steps <= 25, "0.2 -> 0.9 followed after %d steps", steps);
}

PD_TEST(cost_model_and_choice) {
    // Flat steps (memory-bound GPU decode): speculation pays at high acceptance, up to k_max.
    pd_spec_cost c;
    pd_spec_cost_init(&c, 1000);
    for (int i = 0; i < 200; i++) pd_spec_cost_observe(&c, 1 + i % 40, 1000 + 2.0 * (1 + i % 40));
    PD_CHECK_NEAR(pd_spec_cost_predict(&c, 1), 1002, 5);
    PD_CHECK_NEAR(pd_spec_cost_predict(&c, 33), 1066, 5);
    double alpha[4] = {0.8, 0.8, 0.1, 0.0};
    int km[4] = {5, 5, 5, 5}, k[4];
    pd_spec_choose(&c, 4, 4, alpha, km, false, k);
    PD_CHECK(k[0] == 5 && k[1] == 5);
    PD_CHECK_EQ(k[3], 0);  // never accepted: never drafted
    // Proportional steps (compute-bound: every token costs as much as a plain step's token):
    // a draft token pays only if it is accepted more than ... never at batch 64.
    pd_spec_cost_init(&c, 1000);
    for (int i = 0; i < 300; i++) pd_spec_cost_observe(&c, 8 + i % 64, 100.0 * (8 + i % 64));
    double a64[64];
    int km64[64], k64[64];
    for (int i = 0; i < 64; i++) a64[i] = 0.7, km64[i] = 4;
    PD_CHECK_EQ(pd_spec_choose(&c, 64, 64, a64, km64, false, k64), 0);
    // A draft model whose forward costs as much as a target step kills speculation at alpha 0.5.
    pd_spec_cost_init(&c, 1000);
    for (int i = 0; i < 200; i++) pd_spec_cost_observe(&c, 1 + i % 8, 1000);
    pd_spec_cost_observe_draft(&c, 1000);
    double a1[1] = {0.5};
    int km1[1] = {4}, k1[1];
    PD_CHECK_EQ(pd_spec_choose(&c, 1, 1, a1, km1, true, k1), 0);
    pd_spec_cost_observe_draft(&c, 1);  // a cheap draft (EMA: converges)
    for (int i = 0; i < 50; i++) pd_spec_cost_observe_draft(&c, 10);
    a1[0] = 0.9;
    PD_CHECK(pd_spec_choose(&c, 1, 1, a1, km1, true, k1) >= 3);
}

// A step costs 100 us with no drafts, p[0] with a draft of 1 token, p[1] with longer ones.
static double cost_of(void *ud, int max_k, int n_tokens) {
    (void)n_tokens;
    const double *p = ud;
    return max_k == 0 ? 100 : max_k == 1 ? p[0] : p[1];
}

PD_TEST(measured_step_shapes) {
    pd_spec_shapes t;
    pd_spec_shapes_init(&t);
    PD_CHECK(pd_spec_shapes_get(&t, 7) < 0);  // not measured
    PD_CHECK(pd_spec_shapes_get(&t, 0) < 0);  // 0 is no key
    pd_spec_shapes_observe(&t, 0, 100);       // ignored
    pd_spec_shapes_observe(&t, 7, 5000);  // a first step: not a measurement yet
    PD_CHECK(pd_spec_shapes_get(&t, 7) < 0);
    pd_spec_shapes_observe(&t, 7, 100);  // the second replaces it
    PD_CHECK_NEAR(pd_spec_shapes_get(&t, 7), 100, 1e-3);
    // Session 15: up to the PD_SPEC_SHAPE_TRUST-th step the least of them (a transient only adds time) ...
    for (int i = 2; i < PD_SPEC_SHAPE_TRUST; i++) pd_spec_shapes_observe(&t, 7, 200);
    PD_CHECK_NEAR(pd_spec_shapes_get(&t, 7), 100, 1e-3);
    pd_spec_shapes_observe(&t, 7, 200);  // ... then EMA: 0.8 old + 0.2 new
    PD_CHECK_NEAR(pd_spec_shapes_get(&t, 7), 120, 1e-3);
    pd_spec_shapes_observe(&t, 7, -5);  // not a time
    PD_CHECK_NEAR(pd_spec_shapes_get(&t, 7), 120, 1e-3);
    {  // A slow 2nd step is replaced by a steady 3rd one; session 14's rule (trust_n 0) kept it in the EMA.
        pd_spec_shapes a, b;
        pd_spec_shapes_init(&a), pd_spec_shapes_init(&b);
        b.trust_n = 0;
        double seq[] = {12000, 9500, 6300, 6350};
        for (int i = 0; i < 4; i++) pd_spec_shapes_observe(&a, 9, seq[i]), pd_spec_shapes_observe(&b, 9, seq[i]);
        PD_CHECK_NEAR(pd_spec_shapes_get(&a, 9), 6300, 1e-3);
        PD_CHECK(pd_spec_shapes_get(&b, 9) > 8300);  // 9500, then 0.8 x + 0.2 y: 8358
    }
    // Many keys: every one kept while the table has room; beyond, the least recently observed of a
    // probe window is replaced, and the most recent ones stay.
    for (uint32_t k = 1; k <= 200; k++) pd_spec_shapes_observe(&t, k << 20 | k, 1e6);
    for (uint32_t k = 1; k <= 200; k++) pd_spec_shapes_observe(&t, k << 20 | k, (double)k);
    int kept = 0;
    for (uint32_t k = 1; k <= 200; k++) kept += pd_spec_shapes_get(&t, k << 20 | k) == (double)k;
    PD_CHECK(kept >= 150);
    for (uint32_t k = 1000; k < 3000; k++) pd_spec_shapes_observe(&t, k, 1), pd_spec_shapes_observe(&t, k, 1);
    PD_CHECK_NEAR(pd_spec_shapes_get(&t, 2999), 1, 1e-6);
    // The chooser with measured costs: at alpha 0.5, one drafting sequence of 64 pays for neither
    // a verify step measured at 3x a plain step nor one at 1.05x (0.5 more tokens of 64); a
    // single sequence pays for the cheap one, not for the dear one.
    pd_spec_cost c;
    pd_spec_cost_init(&c, 100);
    double alpha[64];
    int km[64], k[64];
    for (int i = 0; i < 64; i++) alpha[i] = i == 0 ? 0.5 : 0, km[i] = i == 0 ? 4 : 0;
    double dear[2] = {300, 300}, cheap[2] = {105, 105};
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 64, 64, 64, alpha, km, NULL, cost_of, dear, k), 0);
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 64, 64, 64, alpha, km, NULL, cost_of, cheap, k), 0);
    PD_CHECK(pd_spec_choose_padded(&c, 1, 1, 1, alpha, km, NULL, cost_of, cheap, k) >= 1);
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 1, 1, 1, alpha, km, NULL, cost_of, dear, k), 0);
    // One candidate in a step of 64 decodes: its drafts are weighed against the 64 tokens the step
    // yields anyway, so a verify step at 1.3x does not pay (weighed against its own 1 token, 1 +
    // 0.94 expected tokens would have looked worth 1.3x); at 1.005x its ~0.9 tokens on 64 (+1.4%)
    // would pay, but not by the margin (PD_SPEC_MIN_GAIN, 5%); 64 such candidates do (+49%).
    double mid[2] = {130, 130}, flat[2] = {100.5, 100.5};
    PD_CHECK(pd_spec_choose_padded(&c, 64, 1, 1, alpha, km, NULL, cost_of, mid, k) >= 1);  // the old weighing
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 64, 1, 64, alpha, km, NULL, cost_of, mid, k), 0);
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 64, 1, 64, alpha, km, NULL, cost_of, flat, k), 0);
    for (int i = 0; i < 64; i++) alpha[i] = 0.5, km[i] = 4;
    PD_CHECK(pd_spec_choose_padded(&c, 64, 64, 64, alpha, km, NULL, cost_of, flat, k) >= 64);
}

// ---- the policy at the step costs measured on an H100 (issue 15, session 8) ------------------------
// Llama-3-8B shape, dummy weights, the controlled-acceptance pair (docs/benchmarks.md, spec8b,
// PD_SPEC_STATS of call 2, draft64): whole-step times per shape of the adaptive and fixed engines.
// Batch 64: plain 64 x 1 token 6814.3 us, verify Q = 2 7579.2 us, Q = 5 (drafts of 3-4) 11286.6 us;
// Q = 3 was not run there: 8580 us, placed between Q = 2 and Q = 5 as in session 6's verify table
// (8.966 / 10.353 / 14.104 ms at Q = 2 / 3 / 5). Batch 1: 6188 / 6166 / 6192 / 6221.7 us at 1 / 2 /
// 3 / 5 tokens. Draft forward (1 layer + lm_head, 1.49 GB): 0.63 ms at batch 1 (spec8b call 1);
// at batch 64 the fixed engine's forwards averaged 651 us over batches 32-64, transients included:
// 700 us is used, on the dear side.
static double h100_step(void *ud, int max_k, int n_tokens) {
    (void)n_tokens;
    int batch = *(const int *)ud;
    static const double b64[5] = {6814.3, 7579.2, 8580.0, 11286.6, 11286.6}, b1[5] = {6188, 6166, 6192, 6221.7, 6221.7};
    return (batch == 64 ? b64 : b1)[max_k < 4 ? max_k : 4];
}

static int h100_choose(int batch, double alpha, double draft_us, int *max_k) {
    pd_spec_cost c;
    pd_spec_cost_init(&c, 6200);
    double a[64];
    int km[64], k[64];
    for (int i = 0; i < batch; i++) a[i] = alpha, km[i] = 4;
    pd_spec_draft_price dp = {draft_us, draft_us};
    int sum = pd_spec_choose_padded(&c, batch, batch, batch, a, km, &dp, h100_step, &batch, k);
    *max_k = 0;
    for (int i = 0; i < batch; i++) *max_k = k[i] > *max_k ? k[i] : *max_k;
    return sum;
}

PD_TEST(h100_costs_draft_at_batch_64) {
    int mk;
    // Acceptance 0.73 at batch 64: drafting pays (tokens per us: plain 64 / 6814 = 9.39e-3; every
    // sequence at k = 2: 64 x 2.26 / (8580 + 1400) = 14.5e-3), so the policy drafts for every sequence.
    int sum = h100_choose(64, 0.73, 700, &mk);
    PD_CHECK(sum >= 64);
    PD_CHECK(mk >= 1);
    // ... and at acceptance 0.1 it does not (1.1 x 64 tokens for 7579 + 700 us is a loss).
    PD_CHECK_EQ(h100_choose(64, 0.1, 700, &mk), 0);
    // Batch 1 at 0.73 (spec8b: k = 4 measured 2.08x): a long draft.
    PD_CHECK(h100_choose(1, 0.73, 630, &mk) >= 3);
    // What stopped drafting at batch 64 on the card: a draft priced at ~4.2 ms or more makes even
    // k = 1 a loss (64 x 1.73 / (7579 + d) < 64 / 6814 for d > 4209 us); with the 5% margin
    // (PD_SPEC_MIN_GAIN, session 11) drafting stops at d > 3648 us (64 x 1.73 / (7579 + d) <
    // 1.05 x 64 / 6814).
    PD_CHECK(h100_choose(64, 0.73, 3550, &mk) > 0);
    PD_CHECK_EQ(h100_choose(64, 0.73, 3750, &mk), 0);
}

// ---- session 11: what resuming and untimed shapes cost --------------------------------------------
PD_TEST(tok_bucket_sizes) {
    int want[] = {1, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16};
    for (int t = 0; t < 14; t++) PD_CHECK_EQ(pd_spec_tok_bucket(t), want[t]);
    PD_CHECK_EQ(pd_spec_tok_bucket(17), 24);
    PD_CHECK_EQ(pd_spec_tok_bucket(25), 32);
    PD_CHECK_EQ(pd_spec_tok_bucket(2048), 2048);
    PD_CHECK_EQ(pd_spec_tok_bucket(2049), 3072);
    for (int t = 1; t < 5000; t++) {  // a bucket holds t, and the next size down does not
        int b = pd_spec_tok_bucket(t);
        PD_CHECK(b >= t && b < 2 * t + 2);
        PD_CHECK_EQ(pd_spec_tok_bucket(b), b);
    }
}

PD_TEST(catchup_priced_at_its_measured_size) {
    pd_spec_dcost d;
    pd_spec_dcost_init(&d);
    // Steady state (every row 1-2 tokens): the steady forward's price, table or not.
    PD_CHECK(fabs(pd_spec_catchup_us(&d, 2048, 650, 32, 64, 2) - 650) < 1e-9);
    PD_CHECK(fabs(pd_spec_catchup_us(NULL, 2048, 650, 32, 40, 1) - 650) < 1e-9);
    // Unmeasured: the steady price scaled by the tokens (32 rows, 320 tokens = 5x the steady 64).
    PD_CHECK(fabs(pd_spec_catchup_us(&d, 2048, 650, 32, 320, 30) - 3250) < 1e-6);
    // ... never below the steady price (a catch-up of 3 tokens in a batch of 32).
    PD_CHECK(fabs(pd_spec_catchup_us(&d, 2048, 650, 32, 34, 3) - 650) < 1e-9);
    // Measured (the warm-up's 3 runs of size 384: the first, a plan build, is not a sample).
    pd_spec_dcost_observe(&d, (uint32_t)pd_spec_tok_bucket(320), 48000);
    pd_spec_dcost_observe(&d, (uint32_t)pd_spec_tok_bucket(320), 1200);
    pd_spec_dcost_observe(&d, (uint32_t)pd_spec_tok_bucket(320), 1200);
    PD_CHECK(fabs(pd_spec_catchup_us(&d, 2048, 650, 32, 320, 30) - 1200) < 1e-6);
    // Above the padded sizes (max_tokens): the scaled price again.
    PD_CHECK(fabs(pd_spec_catchup_us(&d, 256, 650, 32, 320, 30) - 3250) < 1e-6);
}

PD_TEST(untimed_shape_priced_from_warmup) {
    pd_spec_shapes live, warm;
    pd_spec_shapes_init(&live);
    pd_spec_shapes_init(&warm);
    uint32_t plain = 32u << 20 | 32, q5 = 32u << 20 | 160;
    PD_CHECK(pd_spec_shape_us(&live, &warm, q5, plain, -1) < 0);  // nothing timed
    PD_CHECK(pd_spec_shape_us(&live, NULL, q5, plain, -1) < 0);
    for (int r = 0; r < 3; r++) pd_spec_shapes_observe(&warm, plain, r ? 6500 : 30000), pd_spec_shapes_observe(&warm, q5, r ? 9100 : 40000);
    // Warm only: its own times (the first run dropped).
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 9100) < 1e-3);
    // The live plain step (whole step: 6900) plus the warm difference (2600).
    pd_spec_shapes_observe(&live, plain, 6900), pd_spec_shapes_observe(&live, plain, 6900);
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 9500) < 1e-3);
    // A known host overhead of verify steps at this batch (their whole steps over their warm
    // forwards): the warm forward plus that (session 11 call 2: batch 64, Q = 5, warm 9743 us,
    // whole step 10898 us, while warm plain + the difference said 9743).
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, 1100) - 10200) < 1e-3);
    // Timed live: the live time where it is below the warm-up's price ...
    pd_spec_shapes_observe(&live, q5, 9800), pd_spec_shapes_observe(&live, q5, 9800);
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, 1100) - 9800) < 1e-3);
    // ... above it, not before PD_SPEC_SHAPE_TRUST live steps (session 15: one slow step priced a
    // verify shape 1.5x a plain one, drafting stopped, and the shape was never timed again) ...
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 9500) < 1e-3);
    for (int i = 2; i < PD_SPEC_SHAPE_TRUST; i++) pd_spec_shapes_observe(&live, q5, 9800);
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 9800) < 1e-3);  // ... then the live time
    pd_spec_shapes_init(&live);  // session 14's rule (trust_n 0): the live time at once
    live.trust_n = 0;
    pd_spec_shapes_observe(&live, plain, 6900), pd_spec_shapes_observe(&live, plain, 6900);
    pd_spec_shapes_observe(&live, q5, 14000), pd_spec_shapes_observe(&live, q5, 14000);
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 14000) < 1e-3);
    live.trust_n = PD_SPEC_SHAPE_TRUST;
    PD_CHECK(fabs(pd_spec_shape_us(&live, &warm, q5, plain, -1) - 9500) < 1e-3);
}

PD_TEST(nomatch_retries_back_off_then_idle) {
    int want[] = {1, 2, 4, 8, 16};
    for (int m = 1; m <= PD_SPEC_NOMATCH_RETRIES; m++) PD_CHECK_EQ(pd_spec_nomatch_wait(m), want[m - 1]);
    PD_CHECK_EQ(pd_spec_nomatch_wait(PD_SPEC_NOMATCH_RETRIES + 1), -1);
}

// Session 10's batch-32/64 runs: sequences that had stopped drafting resumed after a probe and
// paid an eager catch-up forward (4.4 ms mean, up to 50 ms: new GEMM sizes) priced as a steady one
// (0.7 ms). With the step times of session 8 at batch 64 (h100_step), drafting k = 1 at acceptance
// 0.45 pays in sync (64 x 1.45 / (7579 + 700) > 64 / 6814) and after a padded catch-up measured at
// 1.2 ms, but not after an unmeasured catch-up of 64 x 30 tokens (priced at the steady forward
// scaled by its tokens, 10.5 ms); at 0.2 nothing pays (64 x 1.2 / 8279 < 64 / 6814).
PD_TEST(resume_pays_only_with_its_catchup) {
    int mk;
    pd_spec_dcost d;
    pd_spec_dcost_init(&d);
    double steady = 700;
    double resume = pd_spec_catchup_us(&d, 2048, steady, 64, 64 * 30, 30);
    PD_CHECK(fabs(resume - 10500) < 1e-6);
    PD_CHECK_EQ(h100_choose(64, 0.45, resume, &mk), 0);
    PD_CHECK(h100_choose(64, 0.45, steady, &mk) > 0);
    PD_CHECK_EQ(h100_choose(64, 0.2, steady, &mk), 0);
    for (int r = 0; r < 3; r++) pd_spec_dcost_observe(&d, (uint32_t)pd_spec_tok_bucket(64 * 30), r ? 1200 : 50000);
    resume = pd_spec_catchup_us(&d, 2048, steady, 64, 64 * 30, 30);
    PD_CHECK(fabs(resume - 1200) < 1e-6);
    PD_CHECK(h100_choose(64, 0.45, resume, &mk) > 0);
    PD_CHECK_EQ(h100_choose(64, 0.2, resume, &mk), 0);
    // The catch-up's first forward of a new size (a plan build, 50 ms) is not what it is priced at.
    PD_CHECK(resume < 2 * steady);
}

// Mixed estimates at batch 64 (session 11 call 3: 11-19 Q = 5 steps at batch 64 for a few
// sequences with high estimates): 4 sequences at 0.9, 60 at 0.5. The greedy path grows the four
// to k = 4 (marginal gains 0.9 .. 0.66 > 0.5) before the others get k = 1, so every point where
// all draft is a Q = 5 step (11.3 ms + 4 draft forwards: below plain); every sequence at k = 1
// (Q = 2: 97.6 tokens in 7579 + 700 us, +26% over plain) is found by the uniform scan.
PD_TEST(uniform_lengths_beat_the_greedy_path) {
    pd_spec_cost c;
    pd_spec_cost_init(&c, 6200);
    double a[64];
    int km[64], k[64], batch = 64;
    for (int i = 0; i < 64; i++) a[i] = i < 4 ? 0.9 : 0.5, km[i] = 4;
    pd_spec_draft_price dp = {700, 700};
    int sum = pd_spec_choose_padded(&c, 64, 64, 64, a, km, &dp, h100_step, &batch, k);
    int mx = 0, mn = 99;
    for (int i = 0; i < 64; i++) mx = k[i] > mx ? k[i] : mx, mn = k[i] < mn ? k[i] : mn;
    PD_CHECK_EQ(sum, 64);
    PD_CHECK(mx == 1 && mn == 1);
}

// Batch 1 at a steady per-token acceptance of 0.7 (independent tokens), with the step times an
// H200 measured (session 10 call 1, PD_SPEC_STATS: plain 4175 us; verify steps of 2 / 3 / 5 tokens
// 4395 / 4449 / 4824 us, k = 3 padded to 5; draft forwards 393 us): the adaptive policy, its k
// chosen each step from the acceptance estimate, against fixed k = 4 on the same random draws.
// The long memory keeps it level with fixed k = 4 (within 1%), where the short one alone drafted
// k <= 2 after runs of rejections.
static double h200_step(void *ud, int max_k, int n_tokens) {
    (void)ud, (void)n_tokens;
    static const double b1[5] = {4175, 4395, 4449, 4824, 4824};
    return b1[max_k < 4 ? max_k : 4];
}

static double replay_tokens_per_ms(bool adaptive, bool short_only, int *n_short_k) {
    pd_rng r;
    pd_rng_seed(&r, 11);
    pd_spec_accept acc;
    pd_spec_accept_init(&acc, 0.7);
    double ss = 1.4, fs = 0.6;  // the short memory alone (decay 0.9), as before session 10
    pd_spec_cost c;
    pd_spec_cost_init(&c, 4175);
    pd_spec_draft_price dp = {393, 393};
    double tokens = 0, us = 0;
    int one = 1;
    *n_short_k = 0;
    for (int step = 0; step < 4000; step++) {
        double u[4];
        for (int j = 0; j < 4; j++) u[j] = (double)(pd_rng_next(&r) >> 11) * 0x1.0p-53;  // the same draws for both
        int k = 4;
        if (adaptive) {
            double a[1] = {short_only ? ss / (ss + fs) : pd_spec_accept_alpha(&acc)};
            int km[1] = {4}, kk[1];
            pd_spec_choose_padded(&c, 1, 1, 1, a, km, &dp, h200_step, &one, kk);
            k = kk[0];
        }
        *n_short_k += k <= 2;
        int n = 0;
        while (n < k && u[n] < 0.7) n++;
        tokens += 1 + n;
        us += h200_step(NULL, k, 1) + k * 393.0;
        if (k > 0) {
            pd_spec_accept_update(&acc, k, n);
            ss = 0.9 * ss + n, fs = 0.9 * fs + (n < k);
        }
    }
    return tokens / us * 1e3;
}

PD_TEST(adaptive_level_with_fixed_at_steady_acceptance) {
    int n2_fixed, n2_new, n2_old;
    double fixed = replay_tokens_per_ms(false, false, &n2_fixed);
    double now = replay_tokens_per_ms(true, false, &n2_new), before = replay_tokens_per_ms(true, true, &n2_old);
    printf("  a = 0.7, H200 step times: fixed k = 4 %.4f tokens/ms; adaptive %.4f (k <= 2 in %d of 4000 steps); "
           "with the short memory alone %.4f (k <= 2 in %d)\n", fixed, now, n2_new, before, n2_old);
    PD_CHECK_MSG(now >= 0.99 * fixed, "adaptive %.4f vs fixed %.4f tokens/ms", now, fixed);
    PD_CHECK(n2_new < n2_old);
}

PD_TEST(draft_price_first_and_later_forwards) {
    // Flat verify steps at batch 1 (100 us at any k), alpha 0.9, k up to 4. A step with longest
    // draft m pays forward 1 + (m - 1) later forwards: when only forward 1 is dear, every draft
    // after the first is nearly free and the longest one is taken; when the later ones are dear,
    // the first draft still pays (it costs little) and the path stops sooner.
    pd_spec_cost c;
    pd_spec_cost_init(&c, 100);
    double alpha[1] = {0.9}, flat[2] = {100, 100};
    int km[1] = {4}, k[1];
    pd_spec_draft_price first_dear = {60, 1}, later_dear = {1, 60};
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 1, 1, 1, alpha, km, &first_dear, cost_of, flat, k), 4);
    int n = pd_spec_choose_padded(&c, 1, 1, 1, alpha, km, &later_dear, cost_of, flat, k);
    PD_CHECK(n >= 1 && n < 4);
    // No draft model (NULL): the drafts cost only their verify step.
    PD_CHECK_EQ(pd_spec_choose_padded(&c, 1, 1, 1, alpha, km, NULL, cost_of, flat, k), 4);
}

PD_TEST(draft_cost_ignores_transients) {
    // The draft's forwards as the engine reports them: steady ones per shape (batch bucket << 20 |
    // query length). Batch 32 first: 650 us forwards (the first of each shape dropped).
    const uint32_t k32 = 32u << 20 | 1, k64a = 64u << 20 | 2, k64b = 64u << 20 | 1, k1 = 1u << 20 | 2;
    pd_spec_dcost d;
    pd_spec_dcost_init(&d);
    PD_CHECK(pd_spec_dcost_get(&d, k32) < 0);  // nothing measured
    pd_spec_dcost_observe(&d, k32, 9000);      // the shape's first forward (a graph's first launch)
    PD_CHECK(pd_spec_dcost_get(&d, k32) < 0);  // is not a sample
    pd_spec_dcost_observe(&d, 0, 100);         // no key: ignored
    pd_spec_dcost_observe(&d, k32, -1);        // not a time: ignored
    for (int i = 0; i < 40; i++) pd_spec_dcost_observe(&d, k32, 650);
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k32), 650, 1);
    // Batch 64 never drafted: priced at the estimate over every shape until measured there.
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k64a), 650, 1);
    // Its first forward is a first launch (25 ms): dropped; the steady ones take over.
    pd_spec_dcost_observe(&d, k64a, 25000);
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k64a), 650, 1);
    for (int i = 0; i < 10; i++) pd_spec_dcost_observe(&d, k64a, 700), pd_spec_dcost_observe(&d, k64b, 700);
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k64a), 700, 1);
    // One outlier later (a stall, a transient mislabelled as steady) moves it by at most 20%, and
    // drafting at batch 64 goes on.
    pd_spec_dcost_observe(&d, k64a, 40000);
    double est = pd_spec_dcost_get(&d, k64a);
    PD_CHECK(est <= 1.2 * 700 + 1);
    int mk;
    PD_CHECK(h100_choose(64, 0.73, est, &mk) >= 64);
    // A real change is followed: the forward really costs 2.5x now (1750 us): within 20 forwards.
    for (int i = 0; i < 20; i++) pd_spec_dcost_observe(&d, k64a, 1750);
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k64a), 1750, 35);
    // ... and down again.
    for (int i = 0; i < 25; i++) pd_spec_dcost_observe(&d, k64a, 700);
    PD_CHECK_NEAR(pd_spec_dcost_get(&d, k64a), 700, 15);
    // A shape seen once (a probe's lone catch-up shape) is priced at the estimate over all shapes.
    pd_spec_dcost_observe(&d, k1, 5000);
    PD_CHECK(pd_spec_dcost_get(&d, k1) < 1000);

    // The same forwards through the one all-forwards EMA the policy used before (0.8 / 0.2, every
    // forward, first launches included): after batch 32, the 25 ms first launch at batch 64 prices a
    // draft at 5.5 ms, and at that price the policy does not draft at batch 64 at all, although a
    // steady forward costs 0.7 ms: what spec8b measured (adaptive 1.00x vs fixed k = 4 1.28x).
    pd_spec_cost c;
    pd_spec_cost_init(&c, 6200);
    pd_spec_cost_observe_draft(&c, 9000);
    for (int i = 0; i < 40; i++) pd_spec_cost_observe_draft(&c, 650);
    pd_spec_cost_observe_draft(&c, 25000);
    PD_CHECK(c.draft_us > 4300);
    PD_CHECK_EQ(h100_choose(64, 0.73, c.draft_us, &mk), 0);
}

PD_TEST(probe_backoff) {
    pd_spec_backoff b;
    pd_spec_backoff_init(&b);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 5), PD_SPEC_PERIOD_MIN);  // at least the minimum
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 20.5), 20);
    // Failures double the period, up to PD_SPEC_BACKOFF_MAX x, never past PD_SPEC_PERIOD_MAX.
    for (int i = 1; i <= 3; i++) {
        pd_spec_backoff_result(&b, false);
        PD_CHECK_EQ(pd_spec_backoff_period(&b, 20), 20 << i);
    }
    for (int i = 0; i < 40; i++) pd_spec_backoff_result(&b, false);
    PD_CHECK_EQ(b.mult, PD_SPEC_BACKOFF_MAX);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 16), 16 * PD_SPEC_BACKOFF_MAX);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 4096), PD_SPEC_PERIOD_MAX);
    // A success resets it; nothing else does (session 12: not a new batch bucket either — the
    // period is asked for with the base of the step at hand, the backoff stays).
    pd_spec_backoff_result(&b, true);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 20), 20);
    pd_spec_backoff_result(&b, false);
    pd_spec_backoff_result(&b, false);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 20), 80);
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 40), 160);  // (another batch: another base, the same backoff)
    PD_CHECK_EQ(pd_spec_backoff_period(&b, 0.0 / 0.0), 4 * PD_SPEC_PERIOD_MIN);  // NaN: the minimum base
}

// The probe period's base: the probe's price over the share of a plain step, clamped.
PD_TEST(probe_base_period) {
    // 1.2 ms of probe at 1% of a 6.6 ms step: every ~18 steps.
    PD_CHECK(fabs(pd_spec_probe_base(1200, 6600, 0.01) - 1200 / 66.0) < 1e-9);
    PD_CHECK_EQ(pd_spec_probe_base(10, 6600, 0.01), PD_SPEC_PERIOD_MIN);       // cheap: the minimum
    PD_CHECK_EQ(pd_spec_probe_base(1e9, 6600, 0.01), PD_SPEC_PROBE_BASE_MAX);  // dear: the maximum
    PD_CHECK_EQ(pd_spec_probe_base(0.0 / 0.0, 6600, 0.01), PD_SPEC_PERIOD_MIN);
    PD_CHECK_EQ(pd_spec_probe_base(-5, 6600, 0.01), PD_SPEC_PERIOD_MIN);
    PD_CHECK(fabs(pd_spec_probe_base(10, 0, 0.01) - 1000) < 1e-9);  // a step time below 1 us counts as 1 us
    // Half the share: twice the period.
    PD_CHECK(fabs(pd_spec_probe_base(1200, 6600, 0.005) - 2 * pd_spec_probe_base(1200, 6600, 0.01)) < 1e-9);
}

// A probe runs only where drafting could pay at all: at acceptance 1 for every candidate.
PD_TEST(probe_worth) {
    pd_spec_cost c;
    pd_spec_cost_init(&c, 6200);
    int batch = 64, km[64], k[64];
    for (int i = 0; i < 64; i++) km[i] = 4, k[i] = -7;
    // The H100 step costs at batch 64 with the 1-layer draft (0.7 ms a forward): worth probing.
    pd_spec_draft_price dp = {700, 700};
    PD_CHECK(pd_spec_probe_worth(&c, batch, batch, batch, km, &dp, h100_step, &batch, k));
    for (int i = 0; i < 64; i++) PD_CHECK(k[i] >= 0 && k[i] <= 4);  // (k: scratch, a valid choice)
    // A draft as dear as 3 target steps a forward: not even acceptance 1 pays (k = 1: 2 x 64 tokens
    // for 7579 + 20443 us against 64 for 6814 us; longer drafts are dearer still).
    dp = (pd_spec_draft_price){20443, 20443};
    PD_CHECK(!pd_spec_probe_worth(&c, batch, batch, batch, km, &dp, h100_step, &batch, k));
    // Draft-free at batch 1: a verify step as dear as a plain one pays at acceptance 1.
    batch = 1;
    PD_CHECK(pd_spec_probe_worth(&c, 1, 1, 1, km, NULL, h100_step, &batch, k));
    // One candidate in a batch of 64 whose verify step costs 1.3x: even 4 accepted drafts on 64
    // tokens do not pay for 30% more time.
    double mid[2] = {130, 130};
    PD_CHECK(!pd_spec_probe_worth(&c, 64, 1, 64, km, NULL, cost_of, mid, k));
    // No candidates, no k_max: nothing to probe.
    PD_CHECK(!pd_spec_probe_worth(&c, 64, 0, 64, km, NULL, cost_of, mid, k));
    int z[1] = {0};
    PD_CHECK(!pd_spec_probe_worth(&c, 1, 1, 1, z, NULL, h100_step, &batch, k));
}

// ---- the draining batch's finish-time model (session 13) ----

PD_TEST(drain_step_moments) {
    double m, v;
    pd_spec_step_moments(0.22, 1, &m, &v);  // T in {1, 2}: Bernoulli(0.22) + 1
    PD_CHECK(fabs(m - 1.22) < 1e-12 && fabs(v - 0.22 * 0.78) < 1e-12);
    pd_spec_step_moments(0.5, 0, &m, &v);
    PD_CHECK(m == 1 && v == 0);
    pd_spec_step_moments(1.0, 3, &m, &v);  // every draft accepted: 4 tokens, no spread
    PD_CHECK(fabs(m - 4) < 1e-12 && fabs(v) < 1e-12);
    // k = 2 at 0.6: A in {0, 1, 2} with P 0.4, 0.24, 0.36.
    pd_spec_step_moments(0.6, 2, &m, &v);
    double ea = 0.24 + 2 * 0.36, ea2 = 0.24 + 4 * 0.36;
    PD_CHECK(fabs(m - 1 - ea) < 1e-12 && fabs(v - (ea2 - ea * ea)) < 1e-12);
}

// Simulated mean steps until the last of n sequences (R tokens each, k drafts at alpha) finishes.
static double sim_drain(int n, int R, double alpha, int k, int reps) {
    uint64_t x = 88172645463325252ull;
    double sum = 0;
    for (int r = 0; r < reps; r++) {
        int worst = 0;
        for (int i = 0; i < n; i++) {
            int got = 0, steps = 0;
            while (got < R) {
                int t = 1;
                for (int j = 0; j < k && j < R - got - 1; j++) {  // drafts cut to the budget (the scheduler)
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    if ((double)(x >> 11) / 9007199254740992.0 >= alpha) break;
                    t++;
                }
                got += t, steps++;
            }
            worst = steps > worst ? steps : worst;
        }
        sum += worst;
    }
    return sum / reps;
}

PD_TEST(drain_steps_match_simulation) {
    static const struct { int n, R, k; double a; } C[] = {
        {8, 48, 1, 0.22}, {8, 48, 2, 0.6}, {64, 48, 1, 0.22}, {8, 128, 1, 0.22}, {32, 128, 4, 0.7}, {1, 48, 2, 0.5},
    };
    for (size_t c = 0; c < PD_ARRAY_LEN(C); c++) {
        int R[64], k[64];
        double a[64];
        for (int i = 0; i < C[c].n; i++) R[i] = C[c].R, k[i] = C[c].k, a[i] = C[c].a;
        double model = pd_spec_drain_steps(C[c].n, R, a, k), sim = sim_drain(C[c].n, C[c].R, C[c].a, C[c].k, 2000);
        // The normal approximation within 4.5%, under the simulation (the last step's cut drafts, the
        // counts' skew).
        PD_CHECK(model / sim - 1 < 0.005 && model / sim - 1 > -0.045);
    }
}

PD_TEST(drain_no_tail_for_one_sequence_and_long_budgets) {
    int R[8] = {48}, k[8] = {2};
    double a[8] = {0.5}, m, v;
    pd_spec_step_moments(0.5, 2, &m, &v);
    PD_CHECK(fabs(pd_spec_drain_steps(1, R, a, k) / (48 / m) - 1) < 1e-4);  // batch 1: its mean, no tail
    // R -> infinity: the batch of 8's expected steps approach R / mu (the throughput model's view).
    for (int i = 0; i < 8; i++) R[i] = 10000000, k[i] = 2, a[i] = 0.5;
    PD_CHECK(fabs(pd_spec_drain_steps(8, R, a, k) / (R[0] / m) - 1) < 0.002);
    // ... while at 48 tokens the tail is several percent of the run.
    for (int i = 0; i < 8; i++) R[i] = 48;
    PD_CHECK(pd_spec_drain_steps(8, R, a, k) / (48 / m) > 1.05);
    // Plain sequences only: max R, exactly.
    int R2[3] = {10, 30, 20}, k0[3] = {0, 0, 0};
    double a2[3] = {0.9, 0.9, 0.9};
    PD_CHECK(fabs(pd_spec_drain_steps(3, R2, a2, k0) - 30) < 1e-9);
    // Finished sequences (R 0) do not count.
    int R3[2] = {0, 0};
    PD_CHECK(pd_spec_drain_steps(2, R3, a2, k0) == 0);
}

PD_TEST(drain_choice_monotone_in_alpha) {
    int R[8], k[8];
    double a[8], cost[3] = {1.0, 1.15, 1.2}, prev = 1e9, prev_steps = 1e9;
    for (int s = 1; s <= 9; s++) {
        for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 2, a[i] = 0.1 * s;
        double steps = pd_spec_drain_steps(8, R, a, k), ratio;
        PD_CHECK(steps < prev_steps);
        prev_steps = steps;
        pd_spec_drain_choose(8, R, a, k, cost, 0.05, &ratio);
        PD_CHECK(ratio <= prev + 1e-12);
        prev = ratio;
    }
}

PD_TEST(drain_refuses_the_nonpaying_batch_and_keeps_the_paying_one) {
    int R[64], k[64];
    double a[64], ratio;
    // Session 12's batch-8 engine: acceptance 0.22, k = 1, 48 tokens, a verify step 1.15x a plain
    // one: the step model's +6% is -1.6% for the closed batch: refused.
    double c1[2] = {1.0, 1.15};
    for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 1, a[i] = 0.22;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c1, -1, &ratio), 0);
    PD_CHECK(ratio > 1.0);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(k[i], 0);
    // 128 tokens: the tail is smaller, still not the 5% margin.
    for (int i = 0; i < 8; i++) R[i] = 128, k[i] = 1;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c1, -1, &ratio), 0);
    // Batch 1 keeps its gain (48 / 1.22 steps at 1.15: +6.1%).
    R[0] = 48, k[0] = 1;
    PD_CHECK_EQ(pd_spec_drain_choose(1, R, a, k, c1, -1, &ratio), 1);
    PD_CHECK(k[0] == 1 && ratio < 1 / 1.05);
    // (The default margin, PD_SPEC_DRAIN_MIN_GAIN, is used from here on: -1.)
    // The paying fixture: acceptance 0.6, k = 2, batch 8: ~+30% predicted.
    double c2[3] = {1.0, 1.15, 1.2};
    for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 2, a[i] = 0.6;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c2, -1, &ratio), 2);
    PD_CHECK(ratio < 1 / 1.2 && ratio > 1 / 1.45);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(k[i], 2);
    // Batch 64, same acceptance and costs: still drafts.
    for (int i = 0; i < 64; i++) R[i] = 48, k[i] = 2, a[i] = 0.6;
    PD_CHECK_EQ(pd_spec_drain_choose(64, R, a, k, c2, -1, &ratio), 2);
    // Session 13 call 2's paying batch 64 (acceptance ~0.45, a k = 1 step 1.23x a plain one): a
    // predicted +3% finish-time gain, which the drain margin keeps and the step margin would refuse.
    double c4[2] = {1.0, 1.23};
    for (int i = 0; i < 64; i++) R[i] = 48, k[i] = 1, a[i] = 0.45;
    PD_CHECK_EQ(pd_spec_drain_choose(64, R, a, k, c4, -1, &ratio), 1);
    PD_CHECK(ratio > 1 / 1.05 && ratio < 1 / 1.025);
    PD_CHECK_EQ(pd_spec_drain_choose(64, R, a, k, c4, PD_SPEC_MIN_GAIN, &ratio), 0);
    // A plain sequence with the longest budget: the batch cannot end sooner, drafting only costs.
    for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 2, a[i] = 0.9;
    R[7] = 60, k[7] = 0;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c2, -1, &ratio), 0);
    PD_CHECK(fabs(ratio - 1.15) < 0.01);  // the others finish in ~17 steps at 1.15: the plain one's 60 steps, dearer
    // The cap: a dear longest draft is cut back to the best uniform m.
    double c3[4] = {1.0, 1.1, 1.2, 3.0};
    for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 3, a[i] = 0.7;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c3, -1, &ratio), 2);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(k[i], 2);
    // Half the batch at k = 1 (the per-step choice's greedy path): they set the batch's end, and
    // the longer drafts of the others would only make every step dearer: m = 1.
    for (int i = 0; i < 8; i++) k[i] = i < 4 ? 3 : 1;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c3, -1, &ratio), 1);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(k[i], 1);
    // Nothing drafted: nothing to decide.
    for (int i = 0; i < 8; i++) k[i] = 0;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, c3, -1, &ratio), 0);
    PD_CHECK(ratio == 1);
}

// A closed batch with the policy in the loop (what the engine does while draining): each step the
// per-step choice drafts k = min(K, budget - 1) and the drain model keeps, caps or refuses it, from
// acceptance estimates (pd_spec_accept, prior at the true rate as the engine's population estimate
// gives a new request) either pooled (the engine's rule: the mean of the estimates) or per sequence.
// Returns the batch's time (step costs c[longest draft]) summed over reps runs. mode: 0 never
// drafts, 1 always, 2 drain with pooled estimates, 3 drain with per-sequence estimates.
static double sim_policy(int n, int R0, double a, int K, const double *c, int mode, int reps) {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    double t = 0;
    for (int r = 0; r < reps; r++) {
        int R[64], k[64];
        double al[64];
        pd_spec_accept acc[64];
        for (int i = 0; i < n; i++) R[i] = R0, pd_spec_accept_init(&acc[i], a);
        for (;;) {
            int live = 0;
            double pool = 0;
            for (int i = 0; i < n; i++)
                if (R[i] > 0) live++, pool += pd_spec_accept_alpha(&acc[i]);
            if (!live) break;
            pool /= live;
            for (int i = 0; i < n; i++) {
                k[i] = mode == 0 || R[i] <= 1 ? 0 : (K < R[i] - 1 ? K : R[i] - 1);
                al[i] = mode == 3 ? pd_spec_accept_alpha(&acc[i]) : pool;
            }
            if (mode >= 2) pd_spec_drain_choose(n, R, al, k, c, -1, NULL);
            int m = 0;
            for (int i = 0; i < n; i++) m = R[i] > 0 && k[i] > m ? k[i] : m;
            t += c[m];
            for (int i = 0; i < n; i++) {
                if (R[i] <= 0) continue;
                int A = 0;
                while (A < k[i]) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    if ((double)(x >> 11) / 9007199254740992.0 >= a) break;
                    A++;
                }
                if (k[i] > 0) pd_spec_accept_update(&acc[i], k[i], A);
                R[i] -= 1 + A;
            }
        }
    }
    return t;
}

PD_TEST(drain_policy_in_a_closed_batch) {
    double c[3] = {1.0, 1.15, 1.27};  // plain, k = 1, k = 2 (the 8B shape's verify + draft forwards, roughly)
    // Not paying in a closed batch (acceptance 0.22, batch 8, 48 tokens): drafting always loses ~1.5%;
    // the drain model does not draft.
    double nv = sim_policy(8, 48, 0.22, 1, c, 0, 200), al = sim_policy(8, 48, 0.22, 1, c, 1, 200);
    double dr = sim_policy(8, 48, 0.22, 1, c, 2, 200);
    PD_CHECK(al > nv * 1.005);
    PD_CHECK(dr <= nv * 1.002);
    // Paying (0.5, k up to 2, batch 32): the drain model keeps the gain of drafting (within 2%) ...
    nv = sim_policy(32, 48, 0.5, 2, c, 0, 60), al = sim_policy(32, 48, 0.5, 2, c, 1, 60);
    dr = sim_policy(32, 48, 0.5, 2, c, 2, 60);
    PD_CHECK(nv / al > 1.1);
    PD_CHECK(nv / dr > 0.98 * (nv / al));
    // ... which per-sequence estimates lose: the maximum over 32 noisy estimates reads the batch as
    // slow and refuses (why the engine pools them).
    double ds = sim_policy(32, 48, 0.5, 2, c, 3, 60);
    PD_CHECK(nv / ds < 1.05);
}

// ---- realized against predicted gain (session 14) ----
PD_TEST(calib_factor_ratio_of_sums_clamped) {
    pd_spec_calib c;
    pd_spec_calib_init(&c);
    PD_CHECK(pd_spec_calib_factor(&c, 32) == 1);  // unknown
    pd_spec_calib_observe(&c, 0, 40, 38, 7000, 6800);  // no bucket: ignored
    pd_spec_calib_observe(&c, 32, 40, 0, 7000, 6800);  // no expectation: ignored
    PD_CHECK_EQ(pd_spec_calib_n(&c, 32), 0);
    // Emitted as expected, steps 5% dearer than priced: 1 / 1.05 once PD_SPEC_CALIB_MIN steps were seen.
    for (int i = 0; i < PD_SPEC_CALIB_MIN - 1; i++) pd_spec_calib_observe(&c, 32, 38.4, 38.4, 7350, 7000);
    PD_CHECK(pd_spec_calib_factor(&c, 32) == 1);
    pd_spec_calib_observe(&c, 32, 38.4, 38.4, 7350, 7000);
    PD_CHECK(fabs(pd_spec_calib_factor(&c, 32) - 1 / 1.05) < 1e-9);
    PD_CHECK(pd_spec_calib_factor(&c, 8) == 1);  // another bucket: its own
    // Fewer tokens than expected (an estimate above the requests' acceptance) is the estimates' to
    // correct: the factor is the price part; the token part is reported.
    for (int i = 0; i < 200; i++) pd_spec_calib_observe(&c, 32, 32, 38.4, 7350, 7000);
    PD_CHECK(fabs(pd_spec_calib_factor(&c, 32) - 1 / 1.05) < 1e-9);
    PD_CHECK(fabs(pd_spec_calib_part(&c, 32, 0) - 32 / 38.4) < 1e-3);
    PD_CHECK(fabs(pd_spec_calib_part(&c, 32, 1) - 1 / 1.05) < 1e-9);
    PD_CHECK(pd_spec_calib_part(&c, 5, 0) == 0);
    // Steps far dearer than priced: down to the clamp.
    for (int i = 0; i < 200; i++) pd_spec_calib_observe(&c, 32, 38.4, 38.4, 9000, 7000);
    PD_CHECK(pd_spec_calib_factor(&c, 32) == PD_SPEC_CALIB_LO);
    // An underestimating model earns at most PD_SPEC_CALIB_HI; the old steps are forgotten.
    for (int i = 0; i < 200; i++) pd_spec_calib_observe(&c, 32, 45, 38.4, 6000, 7000);
    PD_CHECK(pd_spec_calib_factor(&c, 32) == PD_SPEC_CALIB_HI);
    // One transient (a step 3x dearer) among steady ones counts as 1.25x: it moves the factor by ~1.5%.
    pd_spec_calib_init(&c);
    for (int i = 0; i < 30; i++) pd_spec_calib_observe(&c, 64, 70, 70, 8000, 8000);
    pd_spec_calib_observe(&c, 64, 70, 70, 24000, 8000);
    double f = pd_spec_calib_factor(&c, 64);
    PD_CHECK(f < 0.99 && f > 0.98);
    // Four such steps at a new bucket: not yet a factor (PD_SPEC_CALIB_MIN), and then not the clamp.
    for (int i = 0; i < 4; i++) pd_spec_calib_observe(&c, 128, 70, 70, 24000, 8000);
    PD_CHECK(pd_spec_calib_factor(&c, 128) == 1);
    for (int i = 0; i < PD_SPEC_CALIB_MIN - 4; i++) pd_spec_calib_observe(&c, 128, 70, 70, 8000, 8000);
    f = pd_spec_calib_factor(&c, 128);
    PD_CHECK(f > 0.88 && f < 0.95);
    for (int i = 0; i < 60; i++) pd_spec_calib_observe(&c, 64, 70, 70, 8000, 8000);
    PD_CHECK(pd_spec_calib_factor(&c, 64) > 0.99);
    // A full table: a new bucket replaces the one seen least often.
    pd_spec_calib_init(&c);
    for (int b = 1; b <= PD_SPEC_CALIB_BUCKETS; b++)
        for (int i = 0; i < b + 4; i++) pd_spec_calib_observe(&c, (uint32_t)b, 10, 10, 100, 100);
    pd_spec_calib_observe(&c, 99, 10, 10, 100, 100);
    PD_CHECK_EQ(pd_spec_calib_n(&c, 1), 0);
    PD_CHECK_EQ(pd_spec_calib_n(&c, 99), 1);
    PD_CHECK_EQ(pd_spec_calib_n(&c, 2), 6);
}

PD_TEST(calib_tokens_for_the_drain_model) {
    pd_spec_calib c;
    pd_spec_calib_init(&c);
    PD_CHECK(pd_spec_calib_tokens(&c, 8) == 1);  // unknown
    for (int i = 0; i < PD_SPEC_CALIB_MIN - 1; i++) pd_spec_calib_observe(&c, 8, 9.0, 10.0, 7000, 7000);
    PD_CHECK(pd_spec_calib_tokens(&c, 8) == 1);  // too few steps
    pd_spec_calib_observe(&c, 8, 9.0, 10.0, 7000, 7000);
    PD_CHECK(fabs(pd_spec_calib_tokens(&c, 8) - 0.9) < 1e-9);
    PD_CHECK(pd_spec_calib_factor(&c, 8) == 1);  // the price part is its own
    for (int i = 0; i < 200; i++) pd_spec_calib_observe(&c, 8, 12.0, 10.0, 7000, 7000);
    PD_CHECK(pd_spec_calib_tokens(&c, 8) == 1);  // more than expected: not raised
    for (int i = 0; i < 200; i++) pd_spec_calib_observe(&c, 8, 5.0, 10.0, 7000, 7000);
    PD_CHECK(pd_spec_calib_tokens(&c, 8) == PD_SPEC_CALIB_LO);
    // In the drain model: batch 8, 48 tokens, a k = 1 step 1.12x a plain one. At an estimated 0.24
    // it predicts +2.7% and drafts; at the emitted 0.93 x 0.24 it refuses.
    int R[8], k[8];
    double a[8], cost[2] = {1.0, 1.12}, r;
    for (int i = 0; i < 8; i++) R[i] = 48, k[i] = 1, a[i] = 0.24;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, cost, -1, &r), 1);
    PD_CHECK(r < 1 / 1.025 && r > 0.95);
    for (int i = 0; i < 8; i++) k[i] = 1, a[i] = 0.24 * 0.93;
    PD_CHECK_EQ(pd_spec_drain_choose(8, R, a, k, cost, -1, &r), 0);
}

PD_TEST(calib_factor_scales_the_choices) {
    pd_spec_cost c;
    pd_spec_cost_init(&c, 100);
    // Batch 32 at acceptance 0.2, a k = 1 step priced 1.1x: 1.2 / 1.1 = +9% drafts; scaled by 0.9 it does not.
    double a[32], p[2] = {110, 125};
    int km[32], k[32];
    for (int i = 0; i < 32; i++) a[i] = 0.2, km[i] = 1;
    PD_CHECK(pd_spec_choose_padded_f(&c, 32, 32, 32, a, km, NULL, cost_of, p, k, 0.05, 1) == 32);
    PD_CHECK(pd_spec_choose_padded_f(&c, 32, 32, 32, a, km, NULL, cost_of, p, k, 0.05, 0) == 32);  // <= 0: 1
    PD_CHECK(pd_spec_choose_padded_f(&c, 32, 32, 32, a, km, NULL, cost_of, p, k, 0.05, 0.9) == 0);
    for (int i = 0; i < 32; i++) PD_CHECK_EQ(k[i], 0);
    // The drain model the same: acceptance 0.5, batch 8, 48 tokens: k = 1 pays ~15%; not at factor 0.85.
    int R[8], kk[8];
    double al[8], cost[2] = {1.0, 1.15}, r1, r2;
    for (int i = 0; i < 8; i++) R[i] = 48, kk[i] = 1, al[i] = 0.5;
    PD_CHECK_EQ(pd_spec_drain_choose_f(8, R, al, kk, cost, -1, 1, &r1), 1);
    for (int i = 0; i < 8; i++) kk[i] = 1;
    PD_CHECK_EQ(pd_spec_drain_choose_f(8, R, al, kk, cost, -1, 0.85, &r2), 0);
    PD_CHECK(r1 == r2);  // the ratio is the model's own
    PD_CHECK(r1 < 1 / 1.025 && r1 * 0.85 > 1 / 1.025 * 0.85 - 1 && 0.85 / r1 < 1.025);
}

// The engine's policy in a closed batch: each step the per-step choice (pd_spec_choose_padded_f over
// the live sequences' own estimates, k up to K and the budget), then, with drain, the drain model
// at their pooled estimate, with calib, both scaled by the realized-gain factor. Steps are priced at
// pred[m] (m: the longest draft; x100 us) and cost real[m]. Returns the batch's time over reps runs.
static double sim_engine(int n, int R0, double a, int K, const double *real, const double *pred, bool drain, bool calib, int reps,
                         double *drafting_share) {
    uint64_t x = 0x2545F4914F6CDD1Dull;
    double t = 0, p[2] = {100 * pred[1], 100 * pred[2]};
    int64_t nd = 0, ns = 0;
    pd_spec_cost cst;
    pd_spec_cost_init(&cst, 100);
    pd_spec_calib cb;  // the engine's: kept across batches
    pd_spec_calib_init(&cb);
    for (int r = 0; r < reps; r++) {
        int R[64], k[64], km[64], idx[64], RR[64], kd[64];
        double al[64], ad[64];
        pd_spec_accept acc[64];
        for (int i = 0; i < n; i++) R[i] = R0, pd_spec_accept_init(&acc[i], a);
        for (;;) {
            int live = 0;
            double pool = 0;
            for (int i = 0; i < n; i++)
                if (R[i] > 0) {
                    idx[live] = i, al[live] = pd_spec_accept_alpha(&acc[i]), pool += al[live];
                    km[live] = K < R[i] - 1 ? K : R[i] - 1;
                    live++;
                }
            if (!live) break;
            pool /= live;
            double f = calib ? pd_spec_calib_factor(&cb, 1) : 1;
            pd_spec_choose_padded_f(&cst, live, live, live, al, km, NULL, cost_of, p, k, -1, f);
            if (drain) {
                for (int j = 0; j < live; j++) RR[j] = R[idx[j]], ad[j] = pool, kd[j] = k[j];
                pd_spec_drain_choose_f(live, RR, ad, kd, pred, -1, f, NULL);
                for (int j = 0; j < live; j++) k[j] = kd[j];
            }
            int m = 0;
            double expt = live, emitted = live;
            for (int j = 0; j < live; j++) {
                m = k[j] > m ? k[j] : m;
                double q = 1;
                for (int h = 0; h < k[j]; h++) q *= al[j], expt += q;
            }
            t += real[m];
            ns++, nd += m > 0;
            for (int j = 0; j < live; j++) {
                int i = idx[j], A = 0;
                while (A < k[j]) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    if ((double)(x >> 11) / 9007199254740992.0 >= a) break;
                    A++;
                }
                if (k[j] > 0) pd_spec_accept_update(&acc[i], k[j], A);
                R[i] -= 1 + A;
                emitted += A;
            }
            if (m > 0) pd_spec_calib_observe(&cb, 1, emitted, expt, 100 * real[m], 100 * pred[m]);
        }
    }
    if (drafting_share) *drafting_share = ns ? (double)nd / (double)ns : 0;
    return t;
}

PD_TEST(policy_in_a_closed_batch_never_loses_and_keeps_the_gain) {
    // The session-13 final check's failing cell: batch 32, 128 tokens, acceptance 0.2, a k = 1 step
    // 1.134x a plain one (6.47 ms plain; verify 32 x 2 with its host work ~6.7 ms, a draft forward
    // 0.64 ms on the H100). Per step that is +5.8% and the step model drafts; the batch's last
    // sequence gains ~1.12x, so drafting loses (simulated: 0.97-1.00x; the card: 0.980 in one of
    // two rounds). The drain model refuses: never slower than plain.
    double c[3] = {1.0, 1.134, 1.27}, sh;
    int B[3] = {8, 32, 64}, T[2] = {48, 128};
    double worst_step = 2;
    for (int b = 0; b < 3; b++)
        for (int t = 0; t < 2; t++) {
            double plain = 6.0 * T[t];  // six runs of T plain steps
            double step = sim_engine(B[b], T[t], 0.2, 2, c, c, false, false, 6, NULL);
            double pol = sim_engine(B[b], T[t], 0.2, 2, c, c, true, true, 6, &sh);
            worst_step = PD_MIN(worst_step, plain / step);
            PD_CHECK(pol <= plain * 1.002);  // (within 0.2%: the last steps' small choices)
            PD_CHECK(sh < 0.02);
        }
    PD_CHECK(worst_step < 0.98);  // what the step model alone loses (the test can fail)
    // Paying (acceptance 0.5-0.6, batch 32, 48 tokens): >= 1.15x kept, within 2.5% of the step model
    // alone (simulated: 1.171 / 1.196 / 1.255x against 1.132 / 1.222 / 1.264x at 0.5 / 0.55 / 0.6: the
    // drain model's cap at k = 1 gains more than the step model's k = 2 at 0.5, a little less at 0.55).
    for (int a = 0; a < 3; a++) {
        double al = 0.5 + 0.05 * a;
        double step = sim_engine(32, 48, al, 2, c, c, false, false, 20, NULL);
        double pol = sim_engine(32, 48, al, 2, c, c, true, true, 20, &sh);
        PD_CHECK(20.0 * 48 / pol >= 1.15);
        PD_CHECK(pol <= step * 1.025);
        PD_CHECK(sh > 0.9);
    }
    // A model that prices a drafting step 10% low (1.05 where it costs 1.155; k = 2 1.15 for 1.3):
    // at acceptance 0.15-0.25, batch 8, 48 tokens, it drafts in 40-95% of the steps and loses up to
    // ~4% (simulated 0.963-0.997x). The realized-gain check (kept across the 40 batches, as the
    // engine keeps it) reads the prices 0.91x and cuts the drafting steps by more than half (0.2%
    // of the steps at 0.15-0.2, 39% at 0.25, where the corrected step gain is still +8%); with the
    // drain model as well it is level (0.9997-1.0000x).
    double lo[3] = {1.0, 1.05, 1.15}, hi[3] = {1.0, 1.155, 1.30}, shc;
    for (int a = 0; a < 3; a++) {
        double al = 0.15 + 0.05 * a;
        double nc = sim_engine(8, 48, al, 2, hi, lo, false, false, 40, &sh);
        sim_engine(8, 48, al, 2, hi, lo, false, true, 40, &shc);
        double dc = sim_engine(8, 48, al, 2, hi, lo, true, true, 40, NULL);
        PD_CHECK(shc < sh * 0.5);
        PD_CHECK(dc <= 40.0 * 48 * 1.005);
        if (a < 2) PD_CHECK(nc > 40.0 * 48 * 1.025);  // (what the mispriced step model loses: the test can fail)
    }
}

// ---- a decision to draft needs evidence (session 15) ----
PD_TEST(evidence_bound_and_uninformed_counts) {
    pd_spec_accept a;
    pd_spec_accept_init(&a, 0.2);
    PD_CHECK_NEAR(pd_spec_accept_evidence(&a, PD_SPEC_PRIOR_EVIDENCE), 2 + PD_SPEC_PRIOR_EVIDENCE, 1e-12);
    PD_CHECK_NEAR(pd_spec_accept_evidence(&a, -1), 0, 1e-12);  // the default prior is no evidence
    pd_spec_accept_update(&a, 1, 1);
    PD_CHECK_NEAR(pd_spec_accept_evidence(&a, -1), 0.98 * 2 + 1 - 2, 1e-12);
    // Eight requests at 0.277 with 3 observations each (the prior's 2 + a probe's) and the prior's
    // evidence: 0.277 - sqrt(0.277 x 0.723 / (8 x 7)) = 0.217 at z = 1.
    double al[8], e[8], m;
    for (int i = 0; i < 8; i++) al[i] = 0.277, e[i] = 3 + PD_SPEC_PRIOR_EVIDENCE;
    double lo = pd_spec_pooled_bound(8, al, e, 1, &m);
    PD_CHECK_NEAR(m, 0.277, 1e-12);
    PD_CHECK_NEAR(lo, 0.277 - sqrt(0.277 * 0.723 / (8 * (3 + PD_SPEC_PRIOR_EVIDENCE))), 1e-9);
    PD_CHECK_NEAR(pd_spec_pooled_bound(8, al, e, 0, NULL), 0.277, 1e-12);
    PD_CHECK_NEAR(pd_spec_pooled_bound(1, al, e, 1, &m), 0.277, 1e-12);  // one candidate: no bound
    e[0] = 0;  // counted as 1 observation
    PD_CHECK(pd_spec_pooled_bound(8, al, e, 1, NULL) < lo - 0.01);
    al[0] = 0.01, e[0] = 1;
    for (int i = 1; i < 8; i++) al[i] = 0.01;
    PD_CHECK(pd_spec_pooled_bound(8, al, e, 4, NULL) == 0);  // never below 0
    // Uninformed counts: the default at the weight of one observation.
    PD_CHECK_NEAR(pd_spec_uninformed_alpha(0, 0, 0.7), 0.7, 1e-12);
    PD_CHECK_NEAR(pd_spec_uninformed_alpha(13, 51, 0.7), 13.7 / 65, 1e-12);
    // Exploring: at most 1 token while uninformed, short of PD_SPEC_EXPLORE_N steps, at a batch > 1.
    PD_CHECK_EQ(pd_spec_explore_cap(false, 0, 4, PD_SPEC_EXPLORE_N, 8), 1);
    PD_CHECK_EQ(pd_spec_explore_cap(false, PD_SPEC_EXPLORE_N - 1, 4, PD_SPEC_EXPLORE_N, 8), 1);
    PD_CHECK_EQ(pd_spec_explore_cap(false, PD_SPEC_EXPLORE_N, 4, PD_SPEC_EXPLORE_N, 8), 4);
    PD_CHECK_EQ(pd_spec_explore_cap(true, 0, 4, PD_SPEC_EXPLORE_N, 8), 4);
    PD_CHECK_EQ(pd_spec_explore_cap(false, 0, 4, PD_SPEC_EXPLORE_N, 1), 4);
    PD_CHECK_EQ(pd_spec_explore_cap(false, 0, 4, 0, 8), 4);
    PD_CHECK_EQ(pd_spec_explore_cap(false, 0, 0, PD_SPEC_EXPLORE_N, 8), 0);
}

PD_TEST(drain_verdict_from_the_bound) {
    // Session 14's final check, batch 8, 46 tokens left, a k = 1 step 6961 us against 6223 us plain:
    // at the lucky 0.277 the drain model drafts (ratio ~0.95); at its bound (0.22) it does not.
    int R[8], k[8];
    double a[8], lo[8], cost[2] = {6223, 6961}, r, rl;
    for (int i = 0; i < 8; i++) R[i] = 46, k[i] = 1, a[i] = 0.277, lo[i] = 0.22;
    PD_CHECK_EQ(pd_spec_drain_choose_lb(8, R, a, NULL, k, cost, -1, 1, &r, &rl), 1);
    PD_CHECK(r < 1 / 1.025 && rl == 1);
    for (int i = 0; i < 8; i++) k[i] = 1;
    PD_CHECK_EQ(pd_spec_drain_choose_lb(8, R, a, lo, k, cost, -1, 1, &r, &rl), 0);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(k[i], 0);
    PD_CHECK(r < 1 / 1.025 && rl > 1 / 1.025);  // the point estimate's ratio, and the bound's
    // Paying (0.55, bound 0.49): drafts, at the point estimate's cap.
    double c3[4] = {5942, 7081, 7700, 8333};
    for (int i = 0; i < 8; i++) k[i] = 3, a[i] = 0.55, lo[i] = 0.49;
    int m = pd_spec_drain_choose_lb(8, R, a, lo, k, c3, -1, 1, &r, &rl);
    int k2[8];
    for (int i = 0; i < 8; i++) k2[i] = 3;
    PD_CHECK(m > 0 && m == pd_spec_drain_choose(8, R, a, k2, c3, -1, NULL));
    PD_CHECK(r < rl && rl < 0.9);
}

static double cost_k(void *ud, int max_k, int n_tokens) {
    (void)n_tokens;
    const double *p = ud;  // p[m]: the step whose longest draft is m
    return p[max_k];
}

// The engine's policy in closed batches with session 15's parts: every batch's requests start from
// prior (informed: as from finished requests, PD_SPEC_PRIOR_EVIDENCE more observations; else the
// method's default, weight 2, capped at 1 token for their first explore_n drafting steps and counted
// in the drain model at their pooled lifetime counts), the per-step choice over their estimates (k up
// to K and the budget), then the drain model at the pooled estimate, its verdict also from the bound
// (z > 0). explore_n = 0, z = 0: session 14's policy. Steps cost real[m] (m: the longest draft) and
// are priced at the same. Returns the time over reps batches (a plain batch: R0 steps of real[0]).
static double sim_ev(int n, int R0, double a, int K, const double *real, double prior, bool informed, double z, int explore_n,
                     int reps, double *share) {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    double t = 0, p100[8];
    for (int m = 0; m <= K; m++) p100[m] = 100 * real[m];
    int64_t nd = 0, ns = 0;
    pd_spec_cost cst;
    pd_spec_cost_init(&cst, 100);
    for (int r = 0; r < reps; r++) {
        int R[64], k[64], km[64], idx[64], RR[64], kd[64], steps[64] = {0};
        int64_t nacc[64] = {0}, nfail[64] = {0};
        double al[64], ad[64], alo[64], ev[64], au[64];
        pd_spec_accept acc[64];
        for (int i = 0; i < n; i++) R[i] = R0, pd_spec_accept_init(&acc[i], prior);
        for (;;) {
            int live = 0;
            int64_t sa = 0, sf = 0;
            for (int i = 0; i < n; i++)
                if (R[i] > 0) {
                    idx[live] = i, al[live] = pd_spec_accept_alpha(&acc[i]);
                    ev[live] = pd_spec_accept_evidence(&acc[i], PD_SPEC_PRIOR_EVIDENCE);
                    km[live] = pd_spec_explore_cap(informed, steps[i], K < R[i] - 1 ? K : R[i] - 1, explore_n, n);
                    sa += nacc[i], sf += nfail[i];
                    live++;
                }
            if (!live) break;
            for (int j = 0; j < live; j++) {
                au[j] = al[j];
                if (!informed && explore_n > 0) au[j] = pd_spec_uninformed_alpha(sa, sf, prior), ev[j] = (double)(sa + sf) / live;
            }
            double pool;
            double lo = pd_spec_pooled_bound(live, au, ev, z, &pool);
            pd_spec_choose_padded_f(&cst, live, live, live, al, km, NULL, cost_k, p100, k, -1, 1);
            for (int j = 0; j < live; j++) RR[j] = R[idx[j]], ad[j] = pool, alo[j] = lo, kd[j] = k[j];
            pd_spec_drain_choose_lb(live, RR, ad, z > 0 ? alo : NULL, kd, real, -1, 1, NULL, NULL);
            int m = 0;
            for (int j = 0; j < live; j++) m = kd[j] > m ? kd[j] : m;
            t += real[m];
            ns++, nd += m > 0;
            for (int j = 0; j < live; j++) {
                int i = idx[j], A = 0;
                while (A < kd[j]) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    if ((double)(x >> 11) / 9007199254740992.0 >= a) break;
                    A++;
                }
                if (kd[j] > 0) pd_spec_accept_update(&acc[i], kd[j], A), steps[i]++, nacc[i] += A, nfail[i] += A < kd[j];
                R[i] -= 1 + A;
            }
        }
    }
    if (share) *share = ns ? (double)nd / (double)ns : 0;
    return t;
}

PD_TEST(first_batch_without_history_and_lucky_estimates) {
    // Step prices relative to a plain step, roughly the H100's 8B fixture (plain, k = 1, 2, 3):
    // batch 8 6.22 / 6.95 / 7.55 / 8.3 ms; batch 32 and 64 dearer per draft.
    double c8[4] = {1.0, 1.117, 1.214, 1.334}, c32[4] = {1.0, 1.12, 1.26, 1.40}, c64[4] = {1.0, 1.17, 1.30, 1.45};
    const double *cs[3] = {c8, c32, c64};
    int B[3] = {8, 32, 64}, reps[3] = {60, 16, 8};
    double worst_old = 2, sh;
    for (int b = 0; b < 3; b++) {
        double plain = reps[b] * 48.0;
        // A first batch with no history (the default 0.7 at weight 2) at a true 0.2: session 14's
        // policy drafts deep on the default and loses (simulated 0.970-0.988x); now ~one exploring
        // step at k = 1, then refused: >= 0.995x.
        double o = sim_ev(B[b], 48, 0.2, 3, cs[b], 0.7, false, 0, 0, reps[b], NULL);
        double nw = sim_ev(B[b], 48, 0.2, 3, cs[b], 0.7, false, PD_SPEC_DRAIN_Z, PD_SPEC_EXPLORE_N, reps[b], &sh);
        worst_old = PD_MIN(worst_old, plain / o);
        PD_CHECK(plain / nw >= 0.995);
        PD_CHECK(sh < 0.05);
        // At a true 0.5 most of the gain stays (simulated 1.22 / 1.18 / 1.08x against 1.27 / 1.17 / 1.10x).
        o = sim_ev(B[b], 48, 0.5, 3, cs[b], 0.7, false, 0, 0, reps[b], NULL);
        nw = sim_ev(B[b], 48, 0.5, 3, cs[b], 0.7, false, PD_SPEC_DRAIN_Z, PD_SPEC_EXPLORE_N, reps[b], NULL);
        PD_CHECK(plain / o > 1.05);
        PD_CHECK(plain / nw - 1 >= 0.75 * (plain / o - 1));
        // Informed, but every estimate starting 0.05 above the truth (a lucky probe, a prior from
        // requests that accepted more) at 0.2-0.25: never below plain. Paying (0.5, informed at
        // the truth): the gain kept within 1%.
        for (int ai = 0; ai < 2; ai++) {
            double al = 0.2 + 0.05 * ai;
            nw = sim_ev(B[b], 48, al, 3, cs[b], al + 0.05, true, PD_SPEC_DRAIN_Z, PD_SPEC_EXPLORE_N, reps[b], NULL);
            PD_CHECK(plain / nw >= 0.999);
        }
        o = sim_ev(B[b], 48, 0.5, 3, cs[b], 0.5, true, 0, 0, reps[b], NULL);
        nw = sim_ev(B[b], 48, 0.5, 3, cs[b], 0.5, true, PD_SPEC_DRAIN_Z, PD_SPEC_EXPLORE_N, reps[b], NULL);
        PD_CHECK(nw <= o * 1.01);
    }
    PD_CHECK(worst_old < 0.99);  // what session 14's policy lost there (the test can fail)
    // Batch 1 keeps its gain at 0.2 (one candidate: no bound; no exploring cap): as session 14's.
    double c1[5] = {1.0, 1.037, 1.070, 1.11, 1.11};
    double o1 = sim_ev(1, 48, 0.2, 4, c1, 0.2, true, 0, 0, 100, NULL), n1 = sim_ev(1, 48, 0.2, 4, c1, 0.2, true, 1, 8, 100, NULL);
    PD_CHECK(n1 <= o1 * 1.0001 && 100 * 48 / n1 > 1.05);
}

PD_TEST(prior_from_finished_requests) {
    pd_spec_prior p;
    pd_spec_prior_init(&p);
    PD_CHECK(pd_spec_prior_get(&p) < 0);
    pd_spec_prior_add(&p, 3, 2, 1);  // too few verify steps: not counted
    pd_spec_prior_add(&p, 10, 0, 0);  // nothing to estimate from
    PD_CHECK_EQ(p.n, 0);
    for (int i = 0; i < PD_SPEC_PRIOR_MIN - 1; i++) pd_spec_prior_add(&p, 20, 9, 11);  // 0.45 each
    PD_CHECK(pd_spec_prior_get(&p) < 0);
    pd_spec_prior_add(&p, 20, 9, 11);
    PD_CHECK(fabs(pd_spec_prior_get(&p) - 0.45) < 1e-12);
    // Each request weighs the same, whatever its length; older ones fade.
    pd_spec_prior_add(&p, 400, 100, 300);  // 0.25
    double g = pd_spec_prior_get(&p);
    PD_CHECK(g < 0.45 && g > 0.39);
    for (int i = 0; i < 300; i++) pd_spec_prior_add(&p, 30, 6, 24);  // 0.2
    PD_CHECK(fabs(pd_spec_prior_get(&p) - 0.2) < 0.001);
}

PD_TEST(method_names) {
    pd_spec_method m;
    PD_CHECK_EQ(pd_spec_method_parse("lookahead", &m), PD_OK);
    PD_CHECK_EQ(m, PD_SPEC_LOOKAHEAD);
    PD_CHECK_STR(pd_spec_method_name(PD_SPEC_NGRAM), "ngram");
    PD_CHECK_EQ(pd_spec_method_parse("medusa", &m), PD_ERR_INVALID);
}

// ---- the acceptance rule, statistically --------------------------------------------------------------

#define SV 12  // vocabulary of the synthetic distributions

// Target and draft logits that differ a lot (the draft likes token 0, the target token 5).
static void target_logits(float *l) {
    for (int i = 0; i < SV; i++) l[i] = (float)(-0.15 * (i - 5) * (i - 5));
}
static void draft_logits(float *l) {
    for (int i = 0; i < SV; i++) l[i] = (float)(-0.3 * i);
}

// Chi-square statistic of counts against the expected probabilities (bins with expectation < 5
// merged into one).
static double chi_square(const int *count, const double *p, int n_bins, int n) {
    double chi = 0, rest_o = 0, rest_e = 0;
    for (int i = 0; i < n_bins; i++) {
        double e = p[i] * n;
        if (e < 5) {
            rest_o += count[i];
            rest_e += e;
            continue;
        }
        chi += (count[i] - e) * (count[i] - e) / e;
    }
    if (rest_e > 0) chi += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
    return chi;
}

typedef enum { PROP_DRAFT, PROP_FIXED } prop_kind;

// First two output tokens of speculative sampling with k = 2 drafts, over n seeds; pairs binned
// (t0 * SV + t1). The exact distribution: p(t0) p(t1 | t0) where the target here is context-free
// except for penalties (presence penalty on t0 changes the second position's distribution).
static void spec_first_tokens(const pd_sampling_params *base, prop_kind kind, int n, int *count) {
    float scratch[SV], q[2][SV], l[SV];
    for (int s = 0; s < n; s++) {
        pd_sampling_params sp = *base;
        sp.seed = (uint64_t)s * 7919 + 13;
        sp.has_seed = true;
        pd_sampler *smp = pd_sampler_new(&sp, SV);
        int32_t d[2];
        for (int j = 0; j < 2; j++) {
            if (kind == PROP_DRAFT) {
                draft_logits(l);
                d[j] = pd_sampler_draft(smp, l, j, q[j]);
            } else {
                d[j] = j == 0 ? 4 : 6;  // a fixed (n-gram style) proposal: point mass
            }
        }
        int32_t out[2];
        int na = 0;
        for (int j = 0; j < 2; j++) {
            target_logits(l);
            bool ok = false;
            out[j] = pd_sampler_verify(smp, l, d[j], kind == PROP_DRAFT ? q[j] : NULL, scratch, &ok, NULL);
            pd_sampler_accept(smp, out[j]);
            if (!ok) break;
            na++;
        }
        if (na == 2) {
            // Both accepted: there is nothing else to compare; the pair is (d0, d1).
        } else if (na == 1) {
            // out[1] is the correction at position 1.
        } else {
            // Rejected at position 0: position 1 is a plain sample (the next step's).
            target_logits(l);
            out[1] = pd_sampler_sample(smp, l, NULL);
        }
        count[out[0] * SV + out[1]]++;
        pd_sampler_free(smp);
    }
}

// Plain sampling's exact pair distribution, computed with the sampler's own processed
// distributions (pd_sampler_probs) so penalties and filters are taken into account.
static void exact_pairs(const pd_sampling_params *base, double *p2) {
    float l[SV], p0[SV], p1[SV];
    pd_sampler *smp = pd_sampler_new(base, SV);
    target_logits(l);
    pd_sampler_probs(smp, l, p0);
    pd_sampler_free(smp);
    for (int a = 0; a < SV; a++) {
        pd_sampler *s2 = pd_sampler_new(base, SV);
        pd_sampler_accept(s2, a);
        target_logits(l);
        pd_sampler_probs(s2, l, p1);
        for (int b = 0; b < SV; b++) p2[a * SV + b] = (double)p0[a] * p1[b];
        pd_sampler_free(s2);
    }
}

// chi-square critical value at p = 0.001 for df degrees of freedom (Wilson-Hilferty).
static double chi_crit(int df) {
    double z = 3.09, h = 2.0 / (9.0 * df);
    double x = 1 - h + z * sqrt(h);
    return df * x * x * x;
}

static int nonzero_bins(const double *p, int n, int n_draws) {
    int k = 0, small = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] * n_draws >= 5) k++;
        else if (p[i] > 0) small = 1;
    }
    return k + small;
}

static double run_stat(const pd_sampling_params *sp, prop_kind kind, int n, double *crit) {
    static int count[SV * SV];
    static double p2[SV * SV];
    memset(count, 0, sizeof count);
    spec_first_tokens(sp, kind, n, count);
    exact_pairs(sp, p2);
    int df = nonzero_bins(p2, SV * SV, n) - 1;
    *crit = chi_crit(df);
    return chi_square(count, p2, SV * SV, n);
}

PD_TEST(rejection_sampling_matches_target_distribution) {
    const int n = 40000;
    struct {
        float temperature, top_p, presence;
        int top_k;
        prop_kind kind;
        const char *name;
    } cases[] = {
        {1.0f, 1.0f, 0.0f, 0, PROP_DRAFT, "draft model, T=1"},
        {0.7f, 1.0f, 0.0f, 0, PROP_DRAFT, "draft model, T=0.7"},
        {1.0f, 0.9f, 0.0f, 6, PROP_DRAFT, "draft model, top-k 6, top-p 0.9"},
        {1.0f, 1.0f, 1.5f, 0, PROP_DRAFT, "draft model, presence penalty"},
        {1.0f, 1.0f, 0.0f, 0, PROP_FIXED, "draft-free proposal (point mass)"},
        {1.2f, 0.95f, 0.8f, 0, PROP_FIXED, "draft-free, T=1.2, top-p, penalty"},
    };
    for (size_t c = 0; c < PD_ARRAY_LEN(cases); c++) {
        pd_sampling_params sp = pd_sampling_params_default();
        sp.temperature = cases[c].temperature;
        sp.top_p = cases[c].top_p;
        sp.top_k = cases[c].top_k;
        sp.presence_penalty = cases[c].presence;
        double crit, chi = run_stat(&sp, cases[c].kind, n, &crit);
        printf("  %-40s chi2 %.1f (critical at p=0.001: %.1f)\n", cases[c].name, chi, crit);
        PD_CHECK_MSG(chi < crit, "%s: speculative sampling deviates from the target: chi2 %.1f >= %.1f", cases[c].name, chi, crit);
        // The broken rule (resample from p on rejection) must be caught by the same test.
        pd_sampler_debug_break_spec(true);
        double crit_b, chi_b = run_stat(&sp, cases[c].kind, n, &crit_b);
        pd_sampler_debug_break_spec(false);
        printf("  %-40s broken rule: chi2 %.1f\n", "", chi_b);
        PD_CHECK_MSG(chi_b > crit_b, "%s: the broken acceptance rule went undetected (chi2 %.1f < %.1f)", cases[c].name, chi_b, crit_b);
    }
}

PD_TEST(speculative_sampling_is_reproducible_and_greedy_exact) {
    float l[SV], q[SV], scratch[SV];
    pd_sampling_params sp = pd_sampling_params_default();
    sp.seed = 42;
    sp.has_seed = true;
    int32_t first[2][8];
    for (int rep = 0; rep < 2; rep++) {
        pd_sampler *s = pd_sampler_new(&sp, SV);
        for (int i = 0; i < 8; i++) {
            draft_logits(l);
            int32_t d = pd_sampler_draft(s, l, 0, q);
            target_logits(l);
            bool ok;
            first[rep][i] = pd_sampler_verify(s, l, d, q, scratch, &ok, NULL);
            pd_sampler_accept(s, first[rep][i]);
        }
        pd_sampler_free(s);
    }
    PD_CHECK(!memcmp(first[0], first[1], sizeof first[0]));  // a pure function of (seed, position)
    // Greedy: the target's argmax whatever the draft; accepted iff equal.
    sp.temperature = 0;
    pd_sampler *g = pd_sampler_new(&sp, SV);
    bool ok;
    target_logits(l);
    PD_CHECK_EQ(pd_sampler_verify(g, l, 3, NULL, scratch, &ok, NULL), 5);
    PD_CHECK(!ok);
    target_logits(l);
    PD_CHECK_EQ(pd_sampler_verify(g, l, 5, NULL, scratch, &ok, NULL), 5);
    PD_CHECK(ok);
    pd_sampler_free(g);
}
