// sample — turning one row of logits into a token, with the knobs OpenAI/vLLM clients use:
// temperature (0 = greedy), top-k, top-p, min-p, a seeded per-sequence RNG (reproducible),
// presence/frequency penalties (on generated tokens, OpenAI semantics), repetition penalty (on
// prompt + generated tokens, HF semantics), and per-token logprobs with top-N alternatives.
//
// Randomness is counter-based: draw number n of a sequence uses pd_sample_uniform(seed, n)
// (backend.h), and the draw walks the surviving tokens in id order. The CUDA backend's sampling
// op (pd_op_sample) does the same, so a seeded request gets the same tokens whether it is
// sampled here or on the device; the engine exports a sampler's state as a pd_sample_row
// (pd_sampler_export_row) and hands the device's answer back (pd_sampler_import_result).
//
// Order of processing: token mask → penalties → logit bias → temperature → top-k → top-p →
// min-p → draw. Logprobs are
// those of the model's raw distribution (log-softmax of the unprocessed logits), as vLLM reports
// by default; greedy ties go to the lowest id (torch.argmax).
//
// A pd_sampler is per sequence (it holds the RNG and token counts); not thread-safe.
#pragma once
#include "backend/backend.h"
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_MAX_LOGPROBS PD_SAMPLE_MAX_TOP  // 20: the device op reports as many

typedef struct pd_sampling_params {
    float temperature;         // 0: greedy
    int top_k;                 // <= 0: off
    float top_p;               // 1: off
    float min_p;               // 0: off
    float presence_penalty;    // 0: off
    float frequency_penalty;   // 0: off
    float repetition_penalty;  // 1: off
    uint64_t seed;
    bool has_seed;             // false: seeded from a process-wide counter + time
    int n_logprobs;            // -1: none; 0: only the chosen token's; N <= PD_MAX_LOGPROBS: top-N too
} pd_sampling_params;
pd_sampling_params pd_sampling_params_default(void);
// Checks ranges; err names the field ("temperature must be >= 0").
pd_status pd_sampling_params_validate(const pd_sampling_params *p, pd_err *err);

typedef struct pd_sample_result {
    int32_t token;
    float logprob;             // of token (raw distribution); valid if n_logprobs >= 0
    int n_top;
    int32_t top_ids[PD_MAX_LOGPROBS];
    float top_logprobs[PD_MAX_LOGPROBS];
} pd_sample_result;

// ---- constraints: logit bias and token masks (constrained decoding) ------------------------------
// Applied before everything else: the mask sets disallowed tokens to -inf, then the penalties,
// then the bias is added (a bias <= PD_SAMPLE_BIAS_BAN = -100 bans the token: -inf, so it can
// never be drawn, as OpenAI documents for -100). The mask comes from a source the sampler does not
// know (a grammar matcher, api/): fill writes the allowed tokens as (vocab + 31) / 32 words and
// returns how many are allowed; accept is told every token the sampler's sequence takes.
typedef struct pd_logit_bias {
    int32_t token;
    float bias;
} pd_logit_bias;

typedef struct pd_token_mask_ops {
    int (*fill)(void *ud, uint32_t *mask);
    pd_status (*accept)(void *ud, int32_t token);
    void (*free)(void *ud);
} pd_token_mask_ops;

typedef struct pd_sample_ctl {
    pd_logit_bias *bias;               // owned (pd_malloc), n_bias entries, unique tokens
    int n_bias;
    const pd_token_mask_ops *mask_ops; // NULL: no mask
    void *mask_ud;                     // owned: released with mask_ops->free
} pd_sample_ctl;
// Frees what ctl owns and ctl itself (pd_malloc'd). NULL is a no-op.
void pd_sample_ctl_free(pd_sample_ctl *ctl);

typedef struct pd_sampler pd_sampler;
// out: owned by caller (pd_sampler_free). NULL on OOM.
pd_sampler *pd_sampler_new(const pd_sampling_params *p, int vocab_size);
void pd_sampler_free(pd_sampler *s);
// Records prompt tokens (repetition penalty only).
void pd_sampler_add_prompt(pd_sampler *s, const int32_t *ids, int n);
// Records a generated token (all penalties; the mask source is told).
void pd_sampler_accept(pd_sampler *s, int32_t token);
// Hands ctl (NULL: none) to the sampler, which owns it from then on (an earlier one is freed).
// PD_ERR_NOMEM (ctl freed, the sampler has none) or PD_OK.
pd_status pd_sampler_set_ctl(pd_sampler *s, pd_sample_ctl *ctl);
bool pd_sampler_has_mask(const pd_sampler *s);
// Words of a token mask: (vocab + 31) / 32.
int pd_sampler_mask_words(const pd_sampler *s);
// Writes the allowed tokens of the next sample (device sampling: the row's mask). All tokens when
// the sampler has no mask.
void pd_sampler_fill_mask(pd_sampler *s, uint32_t *mask);
// Samples from logits (vocab floats; modified in place). Returns the token.
int32_t pd_sampler_sample(pd_sampler *s, float *logits, pd_sample_result *out);

// ---- device sampling (pd_op_sample) ------------------------------------------------------------
// Number of penalty entries pd_sampler_export_row writes now (0 when no penalty is on).
int pd_sampler_n_pens(const pd_sampler *s);
// The sampler's next sample as a device row: parameters, seed, the next draw index and, in
// pens[0 .. pd_sampler_n_pens(s)), its penalty entries (one per token); row->pen_begin = pen_begin,
// the entries' offset in the op's array.
void pd_sampler_export_row(const pd_sampler *s, int pen_begin, pd_sample_row *row, pd_sample_pen *pens);
// Takes the op's result for the exported row: fills out (may be NULL) and consumes the draw when
// the row was random (temperature > 0). Returns the token; record it with pd_sampler_accept.
int32_t pd_sampler_import_result(pd_sampler *s, const pd_sample_out *o, pd_sample_result *out);
// Draws made so far (the index of the next one).
uint64_t pd_sampler_n_draws(const pd_sampler *s);
// Continues another sampler's counter (a first token drawn by a prefill worker, disaggregated):
// the next draw uses index n, as it would had the draws been made here.
void pd_sampler_set_n_draws(pd_sampler *s, uint64_t n);

// ---- speculative decoding ----------------------------------------------------------------------
// The processed distribution plain sampling draws from (penalties with the tokens accepted so far,
// temperature, top-k, top-p, min-p), dense over the vocabulary in probs; greedy is one-hot at the
// argmax. logits are modified. Returns the most likely token.
int32_t pd_sampler_probs(pd_sampler *s, float *logits, float *probs);
// A draft model's proposal for the output `offset` places after the tokens accepted so far: q
// (vocab) gets the draft's processed distribution (same knobs as the request), the token is drawn
// from it (greedy: its argmax) with the request's seed on a stream of its own.
int32_t pd_sampler_draft(pd_sampler *s, float *logits, int offset, float *q);
// Verifies a proposed token against the target's logits for the next output position: greedy
// accepts iff draft == the target's argmax (which is returned either way). Random: accepts with
// probability min(1, p(x)/q(x)) (q NULL = a draft-free proposal, a point mass at x), else returns
// a draw from norm(max(0, p - q)) (Leviathan et al. 2023, Chen et al. 2023): the output follows p
// exactly. Draws are pure functions of (seed, position). scratch: vocab floats. Logprobs as plain
// sampling. Record the returned token with pd_sampler_accept before the next position.
int32_t pd_sampler_verify(pd_sampler *s, float *logits, int32_t draft, const float *q, float *scratch, bool *accepted,
                          pd_sample_result *out);
bool pd_sampler_is_greedy(const pd_sampler *s);
// Test hook: on rejection, draw from p instead of the residual (a known-wrong rule the statistical
// test must catch). Process-wide; off by default.
void pd_sampler_debug_break_spec(bool on);

// Index of the largest value, lowest index on ties.
int32_t pd_argmax(const float *x, int n);

#ifdef __cplusplus
}
#endif
