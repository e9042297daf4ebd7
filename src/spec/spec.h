// spec — the pure parts of speculative decoding: proposing draft tokens without a draft model
// (n-gram prompt lookup; lookahead decoding's Jacobi window and n-gram pool) and choosing how many
// tokens to speculate per request and step (an online step-cost model and a per-request acceptance
// estimate). No I/O, clocks or device calls: time comes in as arguments, so it is unit-tested
// exhaustively. The engine (engine/spec.c) runs the draft model, builds the verify batch and
// applies the acceptance rule (model/sample.h: pd_sampler_verify).
//
// Methods:
//   draft      a smaller model with the same tokenizer proposes k tokens autoregressively
//   ngram      prompt lookup: the last n tokens (n_max down to n_min) matched earlier in prompt +
//              output; the tokens that followed the most recent match are proposed
//   lookahead  Fu et al. 2024, built on a causal (1-D) attention kernel: a Jacobi window of W
//              guesses rides after the verify span in the same forward; each step is one Jacobi
//              iteration of the window, and n-grams read along the diagonals of the last N-1
//              iterations fill a per-request pool; the verify span is the pool's most recent
//              n-gram that starts with the last token. See docs/design.md for what differs from
//              the paper (no 2-D window, one candidate per step).
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SPEC_MAX_K 16       // draft tokens per step at most
#define PD_SPEC_MAX_W 16       // lookahead window at most
#define PD_SPEC_MAX_N 8        // lookahead n-gram size at most

typedef enum pd_spec_method {
    PD_SPEC_NONE = 0,
    PD_SPEC_DRAFT = 1,
    PD_SPEC_NGRAM = 2,
    PD_SPEC_LOOKAHEAD = 3,
    PD_SPEC_N = 4,
} pd_spec_method;
const char *pd_spec_method_name(pd_spec_method m);  // "none", "draft", "ngram", "lookahead"
// PD_OK or PD_ERR_INVALID for an unknown name.
pd_status pd_spec_method_parse(const char *s, pd_spec_method *out);

// ---- n-gram prompt lookup ------------------------------------------------------------------------
// Finds the most recent earlier occurrence of toks' last n tokens, n from n_max down to n_min, and
// copies k tokens that followed it into out, continued periodically when the match is less than k
// tokens back (the loop it sits in is assumed to go on). Returns how many (0: no match, else k).
int pd_spec_ngram_propose(const int32_t *toks, int n_toks, int n_min, int n_max, int k, int32_t *out);
// The same, keeping the alignment across a substitution: when no n-gram matches, the proposal
// continues from hint (1 <= hint < n_toks; else nothing), the history position that follows the
// last proposal's source under the assumption that the target replaced one token of it (the
// engine passes src + accepted + 1 after a step that proposed from src). A copy with a token
// changed (an edit, a corrupted source) then goes on being proposed right after the change,
// where the n-gram lookup (its suffix ends in the new token) finds nothing. *src (may be NULL):
// where the proposal was copied from (-1: nothing proposed).
int pd_spec_ngram_propose_at(const int32_t *toks, int n_toks, int n_min, int n_max, int k, int hint, int32_t *out, int *src);

// ---- lookahead: n-gram pool and Jacobi window ----------------------------------------------------
typedef struct pd_spec_pool pd_spec_pool;
// N: n-gram size (2..PD_SPEC_MAX_N): a key token and N-1 continuation tokens. NULL on OOM.
pd_spec_pool *pd_spec_pool_new(int N);
void pd_spec_pool_free(pd_spec_pool *p);
// Adds the n-gram g[0..N) (the newest entry for its key; duplicates move to the front).
void pd_spec_pool_add(pd_spec_pool *p, const int32_t *g);
// The newest n-gram starting with key: copies up to k of its N-1 continuation tokens to out.
int pd_spec_pool_propose(const pd_spec_pool *p, int32_t key, int k, int32_t *out);
int pd_spec_pool_size(const pd_spec_pool *p);  // n-grams held

typedef struct pd_spec_jacobi {
    int W, N;                                  // window width, n-gram size
    int n_hist;                                // iterations kept (<= N - 1)
    int32_t hist[PD_SPEC_MAX_N][PD_SPEC_MAX_W];  // hist[n_hist - 1] is the current window
} pd_spec_jacobi;
// Seeds the window with W tokens of ctx (spread over it; the paper starts from random tokens).
void pd_spec_jacobi_init(pd_spec_jacobi *j, int W, int N, const int32_t *ctx, int n_ctx);
const int32_t *pd_spec_jacobi_window(const pd_spec_jacobi *j);  // (W) current guesses
// One Jacobi iteration: pred[0] is the model's next token at the row before the window, pred[i]
// (1..W) the one at the row of window token i-1. The new window is pred[0..W); n-grams read along
// the diagonals of the kept iterations (token i of iteration t, token i+1 of t+1, ...) go into pool.
void pd_spec_jacobi_step(pd_spec_jacobi *j, const int32_t *pred, pd_spec_pool *pool);

// ---- adaptive length (DISCO-like) ----------------------------------------------------------------
// Per-request acceptance: the per-token acceptance probability alpha of a geometric model (each
// draft accepted with alpha given the previous were), successes = accepted drafts, failures =
// rejections, counted with exponential forgetting on two time scales. The estimate is the long
// one (PD_SPEC_ACCEPT_DECAY_LONG: ~50 verify steps, ~100 observations at alpha 0.7 and k = 4; its
// noise, ~0.04, barely moves the cost model's best k) as long as the recent steps (the short one,
// PD_SPEC_ACCEPT_DECAY_SHORT: ~10 steps) are consistent with it: when they are not — the short
// estimate differs by more than PD_SPEC_ACCEPT_Z standard errors of its own count, a real change
// of the acceptance rate rather than a run of rejections that independent tokens produce — the
// long one restarts at the short one's estimate with the weight of PD_SPEC_ACCEPT_RESTART_W
// observations (the pre-change steps the short memory still holds must not linger in the long
// one). Simulated (tests/unit/test_spec.c): at a steady 0.7, k = 4, ~1 restart in 3000 steps, the
// estimate within 0.58-0.78 (the short memory alone: 0.43-0.89); a change 0.7 -> 0.2 followed in
// 11-19 steps. (A short memory alone, as before session 10, drafted k = 2 after ordinary runs of
// rejections at a steady alpha 0.7.)
#define PD_SPEC_ACCEPT_DECAY_LONG 0.98
#define PD_SPEC_ACCEPT_DECAY_SHORT 0.9
#define PD_SPEC_ACCEPT_Z 2.0
#define PD_SPEC_ACCEPT_RESTART_W 4.0
typedef struct pd_spec_accept {
    double s, f;    // long memory
    double ss, fs;  // short memory
} pd_spec_accept;
void pd_spec_accept_init(pd_spec_accept *a, double prior_alpha);
void pd_spec_accept_update(pd_spec_accept *a, int n_drafted, int n_accepted);
double pd_spec_accept_alpha(const pd_spec_accept *a);

// A new request's prior from the requests that finished before it (session 14): the mean, with
// forgetting (PD_SPEC_PRIOR_DECAY a request), of each finished request's acceptance over its whole
// life (the geometric model's estimate: accepted drafts / (accepted + rejections)), over the requests
// that verified at least PD_SPEC_PRIOR_MIN_STEPS steps; -1 (none) before PD_SPEC_PRIOR_MIN of them.
// What a new request will do over its life is what finished requests did over theirs; before it the
// engine's acceptance over its last verify steps stood for it (pd_spec_accept over every sequence's
// verify: ~50 sequence-steps, at batch 64 the last step or two) — the tail of the previous batch,
// whose sequences accept less in the draft fixture (its estimates fall from ~0.55 to ~0.3 over 48
// tokens): session 14 call 1, a batch of 64 started at 0.33 where its requests did ~0.45, the drain
// model refused at once and nothing drafted to correct it (0.992x of plain where another engine
// gained 1.04x).
#define PD_SPEC_PRIOR_DECAY 0.97
#define PD_SPEC_PRIOR_MIN 4
#define PD_SPEC_PRIOR_MIN_STEPS 4
typedef struct pd_spec_prior {
    double sum, w;  // decayed sum of lifetime acceptances, and of weights
    int64_t n;      // requests counted
} pd_spec_prior;
void pd_spec_prior_init(pd_spec_prior *p);
// A finished request: n_steps verify steps, n_accepted drafts accepted, n_fail steps with a rejection.
void pd_spec_prior_add(pd_spec_prior *p, int64_t n_steps, int64_t n_accepted, int64_t n_fail);
double pd_spec_prior_get(const pd_spec_prior *p);  // -1 before PD_SPEC_PRIOR_MIN requests

// Step cost: time of a target forward as a + b * tokens (exponentially weighted least squares over
// measured steps, started from an optimistic prior that decays away), plus the time of one draft
// forward (EMA). Microseconds.
typedef struct pd_spec_cost {
    double w, sx, sy, sxx, sxy;  // weighted sums
    double draft_us;             // one draft forward; < 0 until measured
    int64_t n_obs;
} pd_spec_cost;
void pd_spec_cost_init(pd_spec_cost *c, double step_us_prior);
void pd_spec_cost_observe(pd_spec_cost *c, int n_tokens, double us);
void pd_spec_cost_observe_draft(pd_spec_cost *c, double us);
double pd_spec_cost_predict(const pd_spec_cost *c, int n_tokens);

// Chooses k[i] in 0..k_max[i] for the n_seqs speculating sequences of a step whose other work is
// n_base tokens (one per decode plus prefill chunks), maximising expected tokens per unit of time:
// sequence i yields 1 + sum_{j=1..k} alpha_i^j tokens, the step costs predict(n_base + sum k)
// + (max k) * draft_us (draft forwards run for the whole batch; 0 without a draft model).
// Greedy on the marginal gain alpha_i^(k+1) (decreasing in k, so greedy is optimal for a fixed
// number of draft forwards); a token is added only if it raises tokens/time. Returns sum k.
int pd_spec_choose(const pd_spec_cost *c, int n_base, int n_seqs, const double *alpha, const int *k_max,
                   bool uses_draft, int *k);
// The cost of a step whose longest draft is max_k and whose real tokens are n_tokens, in
// microseconds: a step run as a padded graph costs its padded shape (every sequence padded to 1 +
// the longest draft's query bucket, the batch to its bucket), not its real tokens, and a shape may
// run eagerly (far dearer than its tokens say). The engine answers from measured step times per
// shape (pd_spec_shapes), falling back to the linear model for shapes not measured yet.
typedef double (*pd_spec_step_cost_fn)(void *ud, int max_k, int n_tokens);
// pd_spec_choose with the step's cost from cost(...). The cost is then a step function of the
// longest draft, so the greedy path is followed to its end (every k_max used) and the best
// tokens/time point on it is kept, rather than stopping at the first token that does not pay.
// n_yield: the tokens the step yields without any draft — one per sequence that gets a token, the
// plain decodes among them, not only the n_seqs that may speculate (values below n_seqs count as
// n_seqs). Drafts are weighed against the whole step's yield: a few candidates in a batch of 64
// gain a few tokens on 64, not on their own count.
// draft: the price of the draft model's forwards at this step (NULL for the draft-free methods): a
// step whose longest draft is m runs forward 1 (catch-up + draft token 1) and m - 1 single-token
// forwards, first_us + (m - 1) * next_us.
// A step drafts only where the best point of its path beats drafting nothing by this share of the
// step's rate (session 11: at a predicted +0.6% — acceptance 0.2 at batch 64 — the adaptive engines
// ran 8-18% below plain decoding; the step model is not better than a few percent, and a closed
// batch's requests finishing unevenly cost what a single step does not show).
#define PD_SPEC_MIN_GAIN 0.05
typedef struct pd_spec_draft_price {
    double first_us, next_us;
} pd_spec_draft_price;
int pd_spec_choose_padded(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                          const pd_spec_draft_price *draft, pd_spec_step_cost_fn cost, void *ud, int *k);
// The same with the margin min_gain instead of PD_SPEC_MIN_GAIN (the engine's PD_SPEC_MIN_GAIN
// knob, a measurement tool; < 0: the default).
int pd_spec_choose_padded_m(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                            const pd_spec_draft_price *draft, pd_spec_step_cost_fn cost, void *ud, int *k, double min_gain);
// The same with the drafting gain scaled by factor (pd_spec_calib_factor; <= 0: 1): a step drafts
// only where factor x (best rate / plain rate) >= 1 + min_gain.
int pd_spec_choose_padded_f(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                            const pd_spec_draft_price *draft, pd_spec_step_cost_fn cost, void *ud, int *k, double min_gain,
                            double factor);

// ---- a draining batch's finish time (session 13) ------------------------------------------------
// pd_spec_choose_padded maximises one step's tokens per second: right while waiting requests refill
// every slot that frees. A batch that drains (no request waiting for a slot) ends when its slowest
// sequence ends, and speculation spreads the sequences' progress: the batch's steps to finish are
// the maximum over its sequences, not the mean (session 12: batch 8 at acceptance 0.22 drafted in
// 57% of the steps for a predicted +5-7% and ran at 0.975x of plain decoding).
// Sequence i has R[i] tokens left to generate (max_tokens - generated: EOS and stop strings make it
// an upper bound) and drafts k[i] tokens a step at acceptance alpha[i] (the geometric model:
// draft j accepted with alpha given the previous ones were). Its tokens per step T: mean
// 1 + sum_{j<=k} alpha^j, variance sum_{j<=k} (2j-1) alpha^j - (mean - 1)^2 (pd_spec_step_moments).
// Its steps to finish, a renewal count: normal with mean R/mu and variance R var/mu^3 (k = 0: R,
// exact). The batch's expected steps: E[max_i N_i] of independent normals, integrated numerically
// over the sequences that can be last (one sequence: its mean, no tail; R -> infinity: R/mu).
// Against a simulation of the geometric model (test_spec): within 4.5% for batches 1-64, k 1-4, a
// little under it (by ~0.5 step: the last step's drafts are cut to the budget, and the counts'
// skew). Not corrected for: at batch 1 that would refuse the last steps' small but real gain.
// The engine passes every drafting sequence the same alpha (the mean of their estimates, see
// engine/spec.c drain_apply): a maximum over noisy per-request estimates is biased low.
void pd_spec_step_moments(double alpha, int k, double *mean, double *var);
double pd_spec_drain_steps(int n, const int *R, const double *alpha, const int *k);
// The draining batch's choice after the per-step one: k[i] (in: the per-step choice, out: capped at
// the chosen m), for each uniform cap m = 1..max k[i] the predicted finish time E[max N(m)] *
// cost[m] (cost[m]: the step's price when its longest draft is m, draft forwards included; cost[0]
// the plain step's) against plain max R * cost[0]; the best m drafts only where plain / it >= 1 +
// min_gain (< 0: PD_SPEC_DRAIN_MIN_GAIN), else every k[i] becomes 0. Returns the chosen m (0: refused); *ratio (may be NULL): the
// best predicted finish time over plain's (1 where nothing drafted). Sequences with k[i] = 0 are
// plain ones in the batch (their R counts: the batch cannot end before them).
int pd_spec_drain_choose(int n, const int *R, const double *alpha, int *k, const double *cost, double min_gain, double *ratio);
// The same with the predicted gain scaled by factor (pd_spec_calib_factor; <= 0: 1): drafts only
// where factor x plain / best >= 1 + min_gain. *ratio stays the model's own (unscaled) prediction.
int pd_spec_drain_choose_f(int n, const int *R, const double *alpha, int *k, const double *cost, double min_gain, double factor,
                           double *ratio);
// The drain model's margin (the engine's default; knob PD_SPEC_DRAIN_GAIN): half the step margin.
// The step margin also stood for "a closed batch's requests finish unevenly", which the drain model
// now predicts; what is left is the error of the step prices. Measured (session 13, calls 1-2): with
// the step margin (5%) the paying fixture's batch 64 (acceptance ~0.45, a predicted +3%) stopped
// drafting at once, 1.00x where drafting throughout gave 1.03-1.04x; simulated closed batches
// (tests/unit/test_spec.c) at acceptance 0.22 refuse with either margin.
#define PD_SPEC_DRAIN_MIN_GAIN 0.025

// ---- a decision to draft needs evidence (session 15) ---------------------------------------------
// Session 14's final check (H100, non-paying draft fixture, acceptance ~0.22, batch 8, 48 tokens):
// one engine of three ran at 0.967x of plain in both rounds. Its timed batches started from the
// finished requests' prior (0.226: refused, right), then a probe's lucky accepts moved the pooled
// estimate to 0.277 (each request's prior holds the weight of 2 observations) and the drain model
// drafted (cap 1) at a predicted -5.7%, and went on at estimates 0.24-0.28 (drafting where the
// estimates run high keeps them there) while the card lost 3.3%. At the true 0.225 the model itself
// predicts 0.985 (a 1.5% gain, under the 2.5% margin): the error was the estimate's, ~+0.03-0.05.
// So the draining batch's verdict "draft" now needs the gain at a lower confidence bound of the
// pooled acceptance, not only at its point estimate (the cap stays the point estimate's choice):
// bound = mean - z sqrt(var), var = mean (1 - mean) sum(1 / e_i) / n^2 over the n candidates, e_i a
// candidate's evidence in observations (pd_spec_accept_evidence). At batch 8 (a k = 1 step 1.12x a
// plain one) the lucky 0.277 bounds at ~0.21: refused. One candidate has no bound (the mean): the
// batch's end is then its own, the per-step choice's (a k = 1 step ~1.04x a plain one at batch 1,
// 1.15x measured at acceptance 0.2); its bound (~0.06 at 0.2 and 8 observations) would refuse it.
#define PD_SPEC_DRAIN_Z 1.0
// A request's evidence: the observations its long memory holds (s + f), plus PD_SPEC_PRIOR_EVIDENCE
// where its prior came from finished requests or recent steps (informed: the mean over many requests
// of the same engine says more about a new one than the 2 observations its estimate starts from);
// an uninformed prior (the method's default) is no evidence: s + f less its weight (>= 0).
// Measured (spec15-1, H100): with 6 the batch-32 bound sat only ~0.03 under a prior that was itself
// 0.05-0.08 above the requests' acceptance (0.27-0.30 against ~0.22: only requests with 4+ verify
// steps count, i.e. those that drafted longest — early in their lives, where this fixture accepts
// more), and two of three engines drafted 1-2 steps there; with 2 (call spec15-2) a paying batch-64
// engine whose k = 1 steps cost 1.25x a plain one (the other's 1.17x) was refused at the bound in half
// its steps (1.053x against 1.096x): 4, between them (knob PD_SPEC_PRIOR_EVIDENCE).
#define PD_SPEC_PRIOR_EVIDENCE 4.0
// prior_evidence: what an informed prior counts for (PD_SPEC_PRIOR_EVIDENCE or the engine's knob);
// < 0: an uninformed one.
double pd_spec_accept_evidence(const pd_spec_accept *a, double prior_evidence);
// The uninformed candidates' acceptance as the drain model takes it: their lifetime counts summed
// (n_acc accepted drafts, n_fail verify steps with a rejection) with the method's default prior at
// the weight of PD_SPEC_UNINFORMED_W observations, (n_acc + W prior) / (n_acc + n_fail + W); their
// evidence n_acc + n_fail, shared. (Their running estimates start from the default at weight 2 and
// forget slowly: in a simulated first batch of 64 at a true 0.25 they read ~0.45 after 4 steps at
// k = 1, and the drain model drafted on at 1.17x a plain step's price, losing 1.7%; one step's 64
// observations pooled tell 0.2 +- 0.05.)
#define PD_SPEC_UNINFORMED_W 1.0
double pd_spec_uninformed_alpha(int64_t n_acc, int64_t n_fail, double prior);
// The pooled mean of alpha[0..n) (in *mean, may be NULL) and its lower bound (>= 0) from the
// candidates' evidence e[0..n) (observations; each counted as at least 1): mean - z sqrt(var), as
// above; n = 1: the mean.
double pd_spec_pooled_bound(int n, const double *alpha, const double *e, double z, double *mean);
// pd_spec_drain_choose_f, the verdict from the bound: the candidates draft only if the drain model
// drafts at acceptance alpha_lo (every candidate's; the same k and budgets) as well; the cap is then
// the point estimate's (alpha) choice. *ratio: the point estimate's predicted ratio, *ratio_lo (may
// be NULL) the bound's (1 where nothing would draft). Returns the cap (0: refused).
int pd_spec_drain_choose_lb(int n, const int *R, const double *alpha, const double *alpha_lo, int *k, const double *cost,
                            double min_gain, double factor, double *ratio, double *ratio_lo);
// An uninformed start must not draft deep: a request whose acceptance prior is only the method's
// default (no finished requests, no recent verify steps to take it from: an engine's first batch)
// drafts at most 1 token a step until it verified PD_SPEC_EXPLORE_N drafting steps of its own. At a
// true 0.2 the default 0.7 (weight 2) had the first batch of every engine draft at cap 3 for 17-27
// of ~45 steps (session 14's final-check logs, steps 1.25-1.3x a plain one); a k = 1 step costs
// ~1.1x at batch 8 and tells as much about the acceptance of the first draft token. Not at batch 1
// (a deep step costs ~1.11x a plain one there, k = 1 ~1.04x: deep drafting at a wrong prior costs
// little, exploring at k = 1 would cost a paying request ~10% of its first steps' gain).
#define PD_SPEC_EXPLORE_N 8
// The cap on k_max: k_max, or at most 1 while !informed, n_steps < explore_n and the step's batch
// n_batch > 1 (explore_n <= 0: off).
int pd_spec_explore_cap(bool informed, int64_t n_steps, int k_max, int explore_n, int n_batch);

// ---- realized against predicted gain (session 14, DISCO-like calibration) ---------------------
// The policy predicts, for each step that drafts, the tokens it yields (the plain yield plus every
// draft's acceptance probability) and what it costs (the verify shape's price plus the draft's
// forwards). The engine then knows what it got: the tokens emitted and the whole step's time. Per
// batch bucket (the step's batch as the engine keys it) this keeps, with exponential forgetting
// (PD_SPEC_CALIB_DECAY a drafting step), the four sums. The factor the policy applies is the price
// part, f = predicted us / realized us: every predicted drafting gain (per step, and the draining
// batch's finish-time gain) is multiplied by it, so a model whose drafting steps cost more than
// it priced them stops drafting where its promise was only that error. The token part (emitted /
// expected) is kept for the diagnostics only: the acceptance estimates are already corrected by
// every verify step, and folded into f their early error (a new request's prior; on the CPU the
// kjv pair's 0.7 prior against ~0.5: emitted / expected 0.77 over a request's first 13 drafting
// steps) outlived the estimates' own correction and switched drafting off at batch 1.
// f is 1 until PD_SPEC_CALIB_MIN drafting steps were seen at the bucket, and held within
// [PD_SPEC_CALIB_LO, PD_SPEC_CALIB_HI]: one slow step (a transient) cannot switch drafting off
// for good, and a model that underestimates earns at most a little more drafting.
#define PD_SPEC_CALIB_DECAY 0.95
#define PD_SPEC_CALIB_MIN 8
// Each step's realized time counts within [1 / PD_SPEC_CALIB_CLIP, PD_SPEC_CALIB_CLIP] x its predicted
// time: a transient (a first draft forward at a new batch, a graph's first launch) moves the factor
// by a few percent, not to the clamp (session 14 call 2: four drafting steps at a new batch of 64,
// unclipped, took it to 0.85, and the policy never drafted there again).
#define PD_SPEC_CALIB_CLIP 1.25
#define PD_SPEC_CALIB_LO 0.85
#define PD_SPEC_CALIB_HI 1.05
#define PD_SPEC_CALIB_BUCKETS 16
typedef struct pd_spec_calib {
    struct {
        uint32_t B;                              // batch bucket (0: free slot)
        double emitted, expected, real_us, pred_us;  // decayed sums
        int64_t n;                               // drafting steps seen
    } b[PD_SPEC_CALIB_BUCKETS];
    int nb;
} pd_spec_calib;
void pd_spec_calib_init(pd_spec_calib *c);
// One drafting step at batch bucket B (> 0): it emitted `emitted` tokens in real_us microseconds,
// where the policy expected `expected` tokens for pred_us. Ignored when a value is not positive.
// A full table drops the bucket seen least often.
void pd_spec_calib_observe(pd_spec_calib *c, uint32_t B, double emitted, double expected, double real_us, double pred_us);
// The factor at bucket B (1 while unknown), clamped to [PD_SPEC_CALIB_LO, PD_SPEC_CALIB_HI].
double pd_spec_calib_factor(const pd_spec_calib *c, uint32_t B);
// Its parts (unclamped; 0 when nothing was seen): emitted / expected tokens (part 0), predicted /
// realized time (part 1, the factor before the clamp).
double pd_spec_calib_part(const pd_spec_calib *c, uint32_t B, int part);
// The token part as the drain model can apply it (session 14, call 4; the engine's PD_SPEC_CALIB_TOK=1,
// off by default: measured no better, see docs/benchmarks.md session 14): emitted / expected tokens at
// bucket B after PD_SPEC_CALIB_MIN drafting steps, clamped to [PD_SPEC_CALIB_LO, 1] (1 while
// unknown): the draining batch's pooled acceptance is multiplied by it. The acceptance estimates
// run ahead of what drafting steps emit where the policy drafts on their high side (session 14 call
// 3, acceptance ~0.24: emitted / expected 0.91-0.96 at batch 8, 0.89-0.91 at batch 1), and a
// draining batch's predicted gain at batch 8 (+2.7%) was then a loss (0.990-0.991x). Not applied to
// the per-step choice: at batch 1 its margin covers the error (1.16x measured) and a token factor
// there would have switched it off (the CPU's kjv pair: 0.77 over a request's first 13 steps).
double pd_spec_calib_tokens(const pd_spec_calib *c, uint32_t B);
// Drafting steps seen at bucket B.
int64_t pd_spec_calib_n(const pd_spec_calib *c, uint32_t B);

// ---- measured step times per shape -----------------------------------------------------------
// A small cache of step times (EMA, microseconds) keyed by a step's shape (the engine's key: the
// batch bucket and the padded tokens; 0 is not a key). A step that drafts nothing must cost what a
// plain step costs: the policy compares shapes it has timed, not a line through every step (a
// line fitted mostly to prefill chunks and plain decodes misjudges a padded verify graph or an
// eager step by several times on a small, launch-bound model).
#define PD_SPEC_SHAPES 256
// Session 15: a shape's price from its 2nd to its PD_SPEC_SHAPE_TRUST-th step is the least of them
// (a transient only ever adds time: one slow step was the price before, and where that price refused
// drafting the shape was never timed again — the final check of session 14, paying fixture, batch 8:
// one engine priced its k = 1 verify shape at 9.5 ms against 6.3 ms on the other, drafted nothing
// after its first batch-8 steps and ran at 0.997x where the other gained 1.345x); from then on an EMA.
// (trust_n 0: session 14's rule, the 2nd step's time then an EMA.)
#define PD_SPEC_SHAPE_TRUST 4
typedef struct pd_spec_shapes {
    uint32_t trust_n;              // PD_SPEC_SHAPE_TRUST (pd_spec_shapes_init) or 0
    uint32_t key[PD_SPEC_SHAPES];  // 0: empty
    float us[PD_SPEC_SHAPES];
    uint32_t n[PD_SPEC_SHAPES];     // observations
    uint32_t clock, last[PD_SPEC_SHAPES];  // least recently observed is replaced when the probe is full
} pd_spec_shapes;
void pd_spec_shapes_init(pd_spec_shapes *t);
void pd_spec_shapes_observe(pd_spec_shapes *t, uint32_t key, double us);
// The shape's time (us), or -1 when not measured: a shape counts from its second step on (the
// first one's time is dropped: first launches and first eager runs cost far more).
double pd_spec_shapes_get(const pd_spec_shapes *t, uint32_t key);
// Observations of the shape so far (0: unknown).
uint32_t pd_spec_shapes_get_n(const pd_spec_shapes *t, uint32_t key);

// ---- the draft model's forward cost, per shape ---------------------------------------------------
// What a draft forward costs depends on its batch (the rows of its lm_head GEMM) and far more on
// whether it is a steady-state one (every row 1 or 2 tokens with logits: the draft's catch-up in a
// step after a drafting step, and forwards 2..k; graph replays on the GPU) or a transient one (a
// catch-up over many tokens after idle steps, prefill chunks mirrored in the same forward, a
// graph's first launch, an eager shape's first run): the transients cost up to tens of steady
// forwards and come once. The policy prices drafting from steady forwards only (the engine passes
// nothing else), per shape (the engine's key: batch bucket and query length), the first forward of
// each shape dropped (pd_spec_shapes' rule) and every later sample clipped to
// [PD_SPEC_DCOST_CLIP^-1, PD_SPEC_DCOST_CLIP] x the shape's estimate, so one outlier moves it by at
// most 20% (0.8 + 0.2 x 2) while a real change is followed within a few forwards. A shape not
// measured yet is priced at the estimate over every shape (an EMA of the same clipped samples): the
// optimistic side, so drafting runs there and gets measured.
#define PD_SPEC_DCOST_CLIP 2.0
typedef struct pd_spec_dcost {
    pd_spec_shapes t;
    double any_us;  // every shape's steady forwards (EMA, clipped), < 0 until measured
    int64_t n_obs;
} pd_spec_dcost;
void pd_spec_dcost_init(pd_spec_dcost *d);
void pd_spec_dcost_observe(pd_spec_dcost *d, uint32_t key, double us);
// The shape's estimate, else any_us, else -1 (nothing measured).
double pd_spec_dcost_get(const pd_spec_dcost *d, uint32_t key);

// ---- what resuming and untimed shapes cost (session 11) --------------------------------------------
// Token counts rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and their 1.5x): eager
// forwards of similar size share a cost entry and, padded to these sizes, their GEMM plans.
int pd_spec_tok_bucket(int t);
// The draft's forward 1 for n drafting sequences whose draft KV lags the target by lag tokens in
// all, max_lag the longest (1-2 a sequence in steady state: the last token, after a fully
// accepted step the bonus token too). steady_us: the steady forward 1's price at this batch. A row
// of more than 2 tokens makes the forward an eager catch-up: its price is the catch-up table's
// entry for pd_spec_tok_bucket(lag) (the engine times every size at warm-up and each live
// catch-up), else, unmeasured or above max_tokens, steady_us scaled by lag / (2 n) — never less
// than steady_us.
double pd_spec_catchup_us(const pd_spec_dcost *catchup, int max_tokens, double steady_us, int n, int lag, int max_lag);
// A step shape's price from live whole-step times and warm-up forward times: the live time when the
// shape was timed live; else, when the warm-up timed it and the plain shape key_plain (the same
// batch, one token a sequence), the live plain step (or, untimed live, the warm one) plus the
// warm-up's difference between the two; else -1. host_us >= 0: what a step of this kind (verify
// or plain) at this batch has cost beyond its warm-up forward so far (the engine's EMA over the
// shapes timed both ways: scheduling, sampling, the update; a verify step's grows with its tokens,
// ~1 ms at batch 64 on an H100 against ~0.3 ms for a plain step): an untimed shape is then its
// warm-up forward plus that.
double pd_spec_shape_us(const pd_spec_shapes *live, const pd_spec_shapes *warm, uint32_t key, uint32_t key_plain, double host_us);
// Session 15: a live time of fewer than live->trust_n steps that exceeds the warm-up's price (as above,
// without the live time) is not trusted yet: the warm-up's price stands until the shape is confirmed
// (drafting at the shape times it again; an untrusted high price that refuses drafting would never be).
// Draft-free methods, adaptive: a sequence whose lookup found nothing looks again this many steps
// later after its n_miss-th miss in a row (1, 2, 4, ...), or -1 after PD_SPEC_NOMATCH_RETRIES misses
// (then it is idle: probes only).
#define PD_SPEC_NOMATCH_RETRIES 5
int pd_spec_nomatch_wait(int n_miss);

// ---- probes: when, who, how often ------------------------------------------------------------
// Probes keep a "does not pay" estimate alive: sequences draft a token now and then although the
// policy says no. A probe is worth its price only if what it can reveal could change the verdict:
// pd_spec_probe_worth asks the policy whether drafting would pay at this step if every candidate's
// acceptance were 1 (the most a probe can show); where even that does not pay (a draft as dear as
// the step, a verify shape the step cannot take), no probe runs. A probe step lets every idle
// candidate draft one token (the engine's choice, session 12): a padded verify step costs the same
// for one sequence's draft as for all of them, and the verdict is then the batch's, not one
// sequence's noisy one (one accepted token moved one estimate, which could not make a batch of
// 64 draft).
// Whether a step with these candidates (as pd_spec_choose_padded's arguments) could draft at all
// were every candidate's acceptance 1. k: scratch (n_seqs). false also on out of memory.
bool pd_spec_probe_worth(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const int *k_max,
                         const pd_spec_draft_price *draft, pd_spec_step_cost_fn cost, void *ud, int *k);
// Steps between probes from the probe's price: probe_us (what a probe step costs beyond a plain
// one: the padded verify step, the draft's forward 1 with its catch-up) spent at most share of the
// plain step time step_us, at least PD_SPEC_PERIOD_MIN and at most PD_SPEC_PROBE_BASE_MAX steps
// (before the backoff below).
#define PD_SPEC_PROBE_BASE_MAX 4096
double pd_spec_probe_base(double probe_us, double step_us, double share);

// While probes keep failing (the probed sequences still do not draft by the policy's own choice,
// or the lookahead window still does not pay), their period doubles, up to PD_SPEC_BACKOFF_MAX
// times the base period; a success resets it. The batch size does not: acceptance is a property
// of the requests (and of the draft), not of the batch, and a step at a new batch size re-decides
// from the estimates at once; only the estimates' freshness is the probes' concern (before session
// 12 every new batch bucket reset the backoff, and a closed batch's ramp crossed several).
#define PD_SPEC_BACKOFF_MAX 256
#define PD_SPEC_PERIOD_MIN 16
#define PD_SPEC_PERIOD_MAX 16384
typedef struct pd_spec_backoff {
    uint32_t mult;  // 1, 2, 4, ... PD_SPEC_BACKOFF_MAX
} pd_spec_backoff;
void pd_spec_backoff_init(pd_spec_backoff *b);
// Steps until the next probe: base (steps, the probe's own price rule) clamped to at least
// PD_SPEC_PERIOD_MIN, times the backoff, at most PD_SPEC_PERIOD_MAX.
int64_t pd_spec_backoff_period(const pd_spec_backoff *b, double base);
void pd_spec_backoff_result(pd_spec_backoff *b, bool success);

#ifdef __cplusplus
}
#endif
