// spec.c — speculative decoding in the engine's step loop (draft model, n-gram prompt lookup,
// lookahead decoding), exact: the target verifies every draft in one forward and the acceptance
// rule of model/sample.h decides (greedy: byte-identical to plain decoding; random: the output
// follows the target's distribution exactly).
//
// A step with speculation, after pd_sched_schedule granted lookahead slots (plan seq n_lookahead):
//
//   1. lengths     k per speculating sequence: adaptive (spec/spec.h pd_spec_choose: per-request
//                  acceptance estimate against the measured step-cost model), or fixed
//   2. proposals   draft model: forward 1 runs every sequence's catch-up span (positions the draft
//                  has no KV for, through the last real token; prefill chunks are mirrored so the
//                  draft prefills with the target) and gives draft token 1; forwards 2..k feed one
//                  draft token each. ngram: prompt lookup. lookahead: the n-gram pool, and a
//                  Jacobi window appended after the drafts
//   3. verify      one target forward over [last token, drafts (, window)] per sequence with
//                  logits at every draft row; pd_sampler_verify row by row, stopping at the first
//                  rejection; the bonus row is sampled plainly when every draft was accepted
//   4. update      pd_sched_update gets n_accepted + the target's token; rejected positions are
//                  overwritten later (the scheduler never caches them); the draft's valid prefix
//                  (draft_pos) is cut back to what was accepted.
//
// The draft model has its own paged KV cache with the same geometry as the target's and is indexed
// by the same block tables, so its blocks follow the target's through the prefix cache and
// preemption: a prefix hit is a draft hit too (draft KV is only ever a speed matter; a stale one
// lowers acceptance, never changes output). Decode workers (--role decode) prefill the draft
// locally after the handoff: the catch-up span covers the prompt, chunked (CATCHUP_MAX) so that it
// never stalls a step.
//
// CUDA graphs: verify steps (1 + k (+ W) query tokens per sequence) run from the target's verify
// graphs (pd_model_set_graph_q: each sequence padded to a query bucket, captured at warm-up with
// the decode graphs); the draft model's single-token forwards from its decode graphs, and its
// forward 1 (a catch-up of 1-2 tokens in steady state) from its Q = 2 graphs.
//
// Greedy requests without penalties, biases or masks (the common case) are checked on the device
// when the backend samples there: the target's (and the draft's) logits stay on the device and
// only the argmax tokens (and requested logprobs) come back (pd_op_sample, the plain path's op),
// instead of k + 1 rows of vocabulary floats per sequence and step. Same tokens as the host rule.
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "engine/engine_impl.h"
#include "spec/spec.h"

#define SHAPE_MAX_Q 32           // step shapes kept for steps of up to this many query tokens per sequence
#define SHAPE_EAGER (1u << 31)   // the key of an eager step's shape
#define CATCHUP_MAX 512  // draft catch-up tokens per sequence per step
// Adaptive: requests whose estimate says "don't" still draft a token now and then (probes: every
// idle candidate of a probe step drafts 1 token; spec.h "probes"), at most PROBE_SHARE of the step
// time spent on probes (the period grows; PD_SPEC_PROBE_SHARE overrides it, for A/B runs).
#define PROBE_SHARE 0.0025  // (0.01 before session 12: a probe step then judged one sequence, now all idle ones)
#define PROBE_SCAN 256   // sequences one probe step lets draft at most
#define PROBE_RETRY 4    // single-sequence probes (PD_SPEC_PROBE_GROUP=0): a due probe whose sequence
                         // had no proposal: the next sequence tries this many steps later
#define DRAFT_LOG_MAX 64 // PD_SPEC_STATS: transient draft forwards logged as they happen, per engine
// Draft-free, adaptive: a sequence whose lookup found no proposal (no n-gram match, an empty pool
// entry) is not idle by the policy's verdict: it looks again 1, 2, 4, ... steps later (busy
// meanwhile), up to PD_SPEC_NOMATCH_RETRIES misses in a row (pd_spec_nomatch_wait); then it is idle
// (probes only). Before session
// 11 one miss made it idle, and in a loop that the next step would have matched it waited for a
// probe (16+ steps, backing off to thousands).
#define LAST_K_NOMATCH (-2)
#define POP_MIN 16  // verify sequence-steps before the engine's acceptance is a new request's prior

struct espec;
typedef struct sreq {
    struct espec *owner;  // the engine's speculation state (its count of busy requests)
    int32_t *toks;  // owned: prompt + outputs
    int n;
    size_t cap;
    int n_prompt;
    int draft_pos;  // draft KV is valid for positions [0, draft_pos); -1: not placed yet
    bool fixed_k;   // seeded random sampling: k does not depend on load (reproducible)
    int max_tokens; // the request's limit (the drain model's remaining budget: max_tokens - generated)
    bool is_random;
    pd_spec_accept acc;
    pd_spec_jacobi jac;
    pd_spec_pool *pool;
    int64_t n_drafted, n_accepted, n_steps;
    int64_t n_fail;  // verify steps with a rejected draft (its lifetime acceptance, pd_spec_prior)
    bool informed;   // its prior came from finished requests or recent verify steps, not the method's default
    // this step
    int k, w;  // drafts proposed, window tokens appended
    int last_k;  // drafts of its last step (-1: none yet; LAST_K_NOMATCH: a draft-free lookup found nothing)
    int n_miss;            // draft-free, adaptive: consecutive lookups that found no proposal
    int64_t retry_at;      // ... the step its next lookup is due (while last_k == LAST_K_NOMATCH)
    bool looked;           // this step: it looked for a proposal (draft-free)
    int ng_src, ng_hint;   // ngram: where its proposal was copied from (-1: none); where the next one
                           // continues when no n-gram matches (pd_spec_ngram_propose_at; -1: nowhere)
    int la_want;  // lookahead slots last asked of the scheduler (-1: not yet)
    uint32_t probe_epoch;  // it drafted in the probe step of this epoch (0: none)
    int32_t draft[PD_SPEC_MAX_K];
    int32_t accepted[PD_SPEC_MAX_K];
    float *q;  // (k, V) draft distributions (random sampling with a draft model); into espec.qbuf
} sreq;

typedef struct bbuild {
    int32_t *tok, *qi, *kvl, *bti, *bt, *lr;
    size_t cap_tok, cap_qi, cap_kvl, cap_bti, cap_bt, cap_lr;
    int nt, ns, nbt, nl;
} bbuild;

typedef struct host_ov {
    uint32_t B;   // batch bucket
    double v, p;  // verify / plain steps' cost beyond their warm-up forward (us; < 0: unknown)
} host_ov;

typedef struct bstat {
    uint32_t B;  // batch bucket (0: free)
    int64_t judged, drafted, step_refused, drain_refused, drain_capped, fast, rejudged;
    double drain_ratio_min, drain_ratio_max;  // the drain model's predicted finish-time ratios (refused or not)
} bstat;

typedef struct espec {
    pd_spec_method method;
    int K, W, N, ngram_min, ngram_max;
    bool adaptive;
    double probe_share;     // PROBE_SHARE unless PD_SPEC_PROBE_SHARE says otherwise
    double min_gain;        // PD_SPEC_MIN_GAIN (spec.h) unless the PD_SPEC_MIN_GAIN knob says otherwise (A/B)
    double drain_gain;      // PD_SPEC_DRAIN_MIN_GAIN (spec.h) unless the PD_SPEC_DRAIN_GAIN knob says otherwise
    int V, bs;
    pd_model *draft;
    pd_model_cache *dcache;
    pd_spec_cost cost;
    pd_spec_cost cost_eager;  // the same for steps that run eagerly (cost holds graph steps'; no graphs: unused)
    pd_spec_shapes shapes;  // measured whole-step times per step shape (graphs on: what the policy compares)
    pd_spec_dcost dcost;    // the draft's steady forwards per shape (draft_key): what drafting is priced at
    // The draft's eager catch-up forwards (a row of more than 2 tokens: a sequence that resumes
    // drafting after idle steps) per padded token count (tok_bucket), seeded at warm-up: what
    // resuming costs (session 10: 4.4 ms mean, up to 50 ms, priced as a steady forward).
    pd_spec_dcost dcatch;
    int catchup_max;        // catch-up forwards are priced (and padded) at tok_bucket() sizes up to this many tokens
    bool catchup_pad;       // pad them (the draft runs graphs: a GPU, where a new GEMM size builds plans)
    // The target's forward time per graph shape at warm-up (shape_key): a verify shape not yet
    // timed live is priced at the live plain step + (warm verify - warm plain) at its batch, not
    // at an optimistic line (session 10: first steps of unmeasured shapes, 12-29 ms, were explored).
    pd_spec_shapes warm;
    int warm_n;             // shapes in warm (0: no warm-up timings)
    // What whole steps cost beyond their warm-up forward, per batch bucket (EMA over the shapes
    // timed both ways; < 0: not yet): verify steps (v) and plain ones (p), pd_spec_shape_us.
    host_ov host[16];
    int n_host;
    // diagnostics (PD_SPEC_STATS): steady and transient draft forwards, the largest transient, and
    // how many transients were logged (the first DRAFT_LOG_MAX)
    int64_t dsteady_n, dsteady_us, dtrans_n, dtrans_us, dtrans_max, n_pad_tok;
    int n_dtrans_logged;
    uint32_t last_vkey;     // the verify step's shape key (0: none this step)
    bool last_vgraph;       // the verify step ran as a graph
    int64_t n_steps;
    bbuild bb;
    float *logits;  // host (cap_logits, V)
    size_t cap_logits;
    float *scratch;  // (threads, V)
    int n_scratch;
    float *qbuf;  // (cap_q, V)
    size_t cap_q;
    pd_sample_result *results;  // (cap_res_seqs, K + 1)
    pd_sample_row *drows;  // device argmax (greedy fast path): (cap_drows) rows and results
    pd_sample_out *douts;
    size_t cap_drows;
    int64_t verify_us, verify_n, draft_us, draft_n;  // time in verify / draft forwards (diagnostics, gdb)
    // diagnostics (PD_SPEC_STATS=1 logs them when the engine stops): probe steps, window steps and
    // probes, host time in the hooks besides the forwards, plain steps and their time
    int64_t n_probes, n_win_steps, n_win_probes, hook_us, hook_plain_us, plain_n, plain_us;
    bool dev_sample;  // the backend samples on the device (and PD_DEVICE_SAMPLING is not 0)
    bool stats;       // PD_SPEC_STATS set (not 0): log diagnostics
    // this step, for the cost model: the verify step's padded tokens, time in draft forwards
    int last_vtok;
    int64_t step_draft_us;
    int64_t next_probe, probe_rot;  // adaptive: the next probe step, which sequence probes
    int64_t next_win_probe;         // lookahead: the next step a window rides along as a probe
    pd_spec_backoff probe_bo, win_bo;  // probe periods grow while probes fail (spec.h)
    int probe_pick;  // single-sequence probes: the idle sequence (plan index) looked up for the probe, -1: none
    bool probe_look;  // this step: idle sequences looked for proposals because a probe is due (draft-free)
    bool probe_group; // a probe step lets every idle candidate draft a token (PD_SPEC_PROBE_GROUP, default
                      // on; off: one sequence in turn, the session-11 rule)
    bool probe_wait;  // the last probe step's sequences (sreq.probe_epoch == probe_epoch) are judged next step
    uint32_t probe_epoch;
    int64_t n_probe_ok;  // probes after which the policy chose to draft (diagnostics)
    // Idle fast path (adaptive, draft-free): with no request busy (every live one chose no draft
    // on its last decode step), no probe due and, for lookahead, the window's last verdict "does
    // not pay" at the same batch, a step has nothing to look at: run_plan returns at once.
    int n_busy;        // live requests whose last_k != 0 (-1: not decoded yet counts as busy)
    int win_quiet_n;   // lookahead: the batch size of the last step whose window did not ride (-1: it rode)
    int64_t n_fast;    // steps that took the fast path (diagnostics)
    // The draft method's fast path (session 12): the last full step chose no draft for a batch of
    // quiet_n single-token decodes with no draft work (-1: it did not). The same batch of decodes,
    // no request busy and no probe due: the choice stands (it changes only with a probe's evidence,
    // a new batch or a request's arrival), and run_plan returns at once. PD_SPEC_IDLE_FAST=0: off.
    int quiet_n;
    bool idle_fast;
    bool paused;  // pd_engine_spec_pause (atomic access): plain steps, the hooks skipped
    bool step_paused;  // this step ran paused (engine thread only)
    int64_t n_probe_skip;  // due probes skipped: drafting could not pay even at acceptance 1 (diagnostics)
    // The drain model (session 13, spec.h pd_spec_drain_choose): while no request waits for a slot
    // (draining: the batch ends with its slowest sequence), a step's drafts must also shorten the
    // batch's predicted finish time by the margin. On by default since session 14 (PD_SPEC_DRAIN=0:
    // off), with its refusals judged again (drain_hold) and a new request's prior from finished
    // requests (pd_spec_prior): session 13 shipped it off (it cut the paying fixture's gain at batch
    // 32-64: 1.06-1.18x against 1.21-1.29x at 32; tools/gpu/NOTES.md).
    bool drain_on;
    bool draining;     // this step: no request waiting or loading (pd_sched_stats)
    bool quiet_drain;  // draining when quiet_n was set (the fast path's verdict holds for that state)
    int64_t n_drain_eval, n_drain_refused, n_drain_capped, n_drain_probe_skip;  // diagnostics
    int *dR;  // per plan seq: the drain model's remaining budgets (dR), lengths (dK), acceptance (dA)
    int *dK;
    double *dA, *dL, *dE, *dU;  // ... and the acceptance's lower bound (dL); per candidate: evidence (dE), acceptance (dU)
    double prior0;  // the method's default acceptance prior (0.7 draft, 0.5 draft-free)
    // Session 15 (spec.h "a decision to draft needs evidence"; PD_SPEC_EVIDENCE=0: session 14's policy):
    // the drain model drafts only where the pooled acceptance's lower bound (z = drain_z) pays too; an
    // uninformed request drafts at most 1 token for its first explore_n drafting steps; a shape's live
    // price needs PD_SPEC_SHAPE_TRUST steps before it outbids the warm-up's.
    bool evidence;
    double drain_z;
    double prior_ev;  // PD_SPEC_PRIOR_EVIDENCE (spec.h) unless the knob says otherwise
    int explore_n;
    int64_t n_drain_lb_refused;  // diagnostics: drafting refused at the bound, not at the point estimate
    // Session 14: a drain refusal is held by the idle fast path for drain_hold steps (PD_SPEC_DRAIN_HOLD;
    // 0: until a probe, a batch change or an arrival, as in session 13), then the step is judged again:
    // a refusal made from prices and estimates that had not settled (a new batch's first steps) no
    // longer stands for the rest of the batch.
    int drain_hold;
    int64_t quiet_until;     // the fast path's verdict holds before this step (INT64_MAX: until it changes)
    bool step_drain_refused; // this step: the drain model refused the per-step choice
    // Realized against predicted gain (spec.h pd_spec_calib; PD_SPEC_CALIB, default on): per batch
    // bucket, the factor every predicted drafting gain is multiplied by.
    pd_spec_calib calib;
    bool calib_on;
    bool calib_tok;  // the drain model's pooled acceptance times the bucket's emitted / expected tokens
                     // (pd_spec_calib_tokens; PD_SPEC_CALIB_TOK=1; default off: measured no better at
                     // batch 8 where drafting does not pay, and one paying batch-32 engine stopped
                     // drafting with it: session 14 call 4)
    uint32_t cal_B;          // this step drafted by the policy's choice: its batch bucket (0: not observed)
    double cal_exp, cal_pred_us;  // ... the tokens it expected and the price it was given
    int64_t cal_emitted;     // ... the tokens it emitted
    // Diagnostics per batch bucket (PD_SPEC_STATS): full steps judged, steps that drafted, refused by
    // the step model, refused / capped by the drain model, fast-path steps, re-judged drain refusals.
    bstat bst[16];
    int n_bst;
    int n_drain_logged, last_drain_verdict, last_drain_n;  // drain decisions logged as they change
    double la_yield;  // lookahead: accepted tokens per Jacobi window token spent (EMA)
    int64_t la_win_tokens;  // window tokens verified this step
    int cap_res_seqs;
    int *kmax, *kch, *sidx, *row0;  // per plan seq
    double *alpha;
    sreq **srs;  // per plan seq: the step's speculating requests (NULL: plain), for after_update
    int srs_n;   // plan seqs srs describes (0: none: the step failed)
    int cap_seqs;
    bool last_valid;  // results describe the last step
    int64_t drafted[PD_SPEC_N], accepted[PD_SPEC_N], emitted[PD_SPEC_N], steps[PD_SPEC_N];
    int64_t pos_reached[PD_SPEC_MAX_K], pos_accepted[PD_SPEC_MAX_K];  // per draft position (pd_engine_stats)
    // The engine's acceptance over every request's verify steps: a new request's estimate starts
    // there (once POP_MIN verify steps were seen), not at the method's fixed prior (0.7 / 0.5),
    // which at a real acceptance of 0.2 made every new request draft for tens of steps (session
    // 11 call 3: batch 32-64 at 0.82-0.92x of plain decoding).
    pd_spec_accept pop;
    int64_t pop_n;
    // Session 14: a new request's prior is the finished requests' lifetime acceptance (spec.h
    // pd_spec_prior) once there are some; PD_SPEC_POP_REQ=0: the engine's acceptance above (A/B).
    pd_spec_prior prior;
    bool pop_req;
} espec;

// ---- helpers ---------------------------------------------------------------------------------------

#define DRAIN_LOG_MAX 96  // PD_SPEC_STATS: drain decisions logged (where the verdict or the batch changes)

// The diagnostics slot of batch bucket B (NULL: no room).
static bstat *bst_of(espec *S, uint32_t B) {
    for (int i = 0; i < S->n_bst; i++)
        if (S->bst[i].B == B) return &S->bst[i];
    if (S->n_bst >= (int)PD_ARRAY_LEN(S->bst)) return NULL;
    bstat *b = &S->bst[S->n_bst++];
    *b = (bstat){.B = B, .drain_ratio_min = 1e9, .drain_ratio_max = -1};
    return b;
}

// A plan's batch bucket (the target's graph bucket, else its sequences).
static uint32_t batch_bucket(pd_model *m, int n_seqs) {
    int B = pd_model_step_tokens(m, n_seqs, 1, n_seqs);
    return (uint32_t)(B >= 1 ? B : n_seqs > 0 ? n_seqs : 0);
}

#define tok_bucket pd_spec_tok_bucket


static void bb_reset(bbuild *b) {
    b->nt = b->ns = b->nbt = b->nl = 0;
}

// Adds a span of n tokens at positions pos .. pos + n - 1 over the block table; logits for its last
// n_logits rows (0: none). false on OOM.
static bool bb_add(bbuild *b, const int32_t *toks, int n, int pos, const int32_t *blocks, int bs, int n_logits) {
    int nb = (pos + n + bs - 1) / bs;
    size_t S2 = (size_t)b->ns + 2;
    if (PD_ARRAY_RESERVE(b->tok, b->cap_tok, (size_t)(b->nt + n)) || PD_ARRAY_RESERVE(b->bt, b->cap_bt, (size_t)(b->nbt + nb)) ||
        PD_ARRAY_RESERVE(b->lr, b->cap_lr, (size_t)(b->nl + n_logits)) || PD_ARRAY_RESERVE(b->qi, b->cap_qi, S2) ||
        PD_ARRAY_RESERVE(b->bti, b->cap_bti, S2) || PD_ARRAY_RESERVE(b->kvl, b->cap_kvl, S2))
        return false;
    if (b->ns == 0) b->qi[0] = b->bti[0] = 0;
    memcpy(b->tok + b->nt, toks, sizeof(int32_t) * (size_t)n);
    memcpy(b->bt + b->nbt, blocks, sizeof(int32_t) * (size_t)nb);
    for (int i = 0; i < n_logits; i++) b->lr[b->nl++] = b->nt + n - n_logits + i;
    b->nt += n;
    b->nbt += nb;
    b->kvl[b->ns] = pos + n;
    b->ns++;
    b->qi[b->ns] = b->nt;
    b->bti[b->ns] = b->nbt;
    return true;
}

static pd_batch bb_batch(const bbuild *b) {
    return (pd_batch){.n_tokens = b->nt, .tokens = b->tok, .n_seqs = b->ns, .q_indptr = b->qi, .kv_lens = b->kvl,
                      .bt_indptr = b->bti, .bt_indices = b->bt, .n_logits = b->nl, .logit_rows = b->lr};
}

static bool reserve_logits(espec *S, int n) {  // n rows of V floats
    return pd_array_reserve(&S->logits, sizeof(float) * (size_t)S->V, &S->cap_logits, (size_t)n) == PD_OK;
}

static bool reserve_seqs(espec *S, int n) {
    if (n <= S->cap_seqs) return true;
    // The per-seq arrays share cap_seqs: each grows from the same capacity to the same new one (on
    // failure those already grown keep it: harmless, as in engine.c's step buffers).
    void *arrs[] = {&S->kmax, &S->kch, &S->sidx, &S->row0, &S->alpha, &S->srs, &S->results, &S->dR, &S->dK, &S->dA, &S->dL, &S->dE, &S->dU};
    size_t elem[] = {sizeof(int), sizeof(int), sizeof(int), sizeof(int), sizeof(double), sizeof(sreq *),
                     sizeof(pd_sample_result) * (size_t)(S->K + 1), sizeof(int), sizeof(int), sizeof(double), sizeof(double),
                     sizeof(double), sizeof(double)};
    size_t cap = 0;
    for (size_t i = 0; i < PD_ARRAY_LEN(arrs); i++) {
        cap = (size_t)S->cap_seqs;
        if (pd_array_reserve(arrs[i], elem[i], &cap, (size_t)n)) return false;
    }
    int c = cap > INT_MAX ? INT_MAX : (int)cap;  // under-stating a capacity is safe
    S->cap_res_seqs = c;
    S->cap_seqs = c;
    return true;
}

// Busy: it drafted on its last decode step, has not decoded yet (-1), or drafts at a fixed length
// (a seeded sampled request looks for proposals every step).
static bool is_busy(const sreq *sr, int last_k) { return last_k != 0 || sr->fixed_k; }

// A request's drafts on its last decode step, keeping the engine's count of busy requests.
static void set_last_k(sreq *sr, int k) {
    bool was = is_busy(sr, sr->last_k), now = is_busy(sr, k);
    if (was != now) sr->owner->n_busy += now ? 1 : -1;
    sr->last_k = k;
}

static bool sreq_push(sreq *r, int32_t t) {
    if (PD_ARRAY_RESERVE(r->toks, r->cap, (size_t)r->n + 1)) return false;
    r->toks[r->n++] = t;
    return true;
}

// A request the device may check: greedy, no penalty, bias or mask (its rows are plain argmaxes).
static bool dev_greedy(const pd_sampler *s) {
    return pd_sampler_is_greedy(s) && pd_sampler_n_pens(s) == 0 && !pd_sampler_has_mask(s);
}

static bool reserve_drows(espec *S, int n) {
    size_t cap = S->cap_drows;
    if (PD_ARRAY_RESERVE(S->drows, cap, (size_t)n)) return false;
    cap = S->cap_drows;
    if (PD_ARRAY_RESERVE(S->douts, cap, (size_t)n)) return false;
    S->cap_drows = cap;
    return true;
}

// ---- set-up ----------------------------------------------------------------------------------------

// The draft must tokenize exactly as the target: same vocabulary size, same token for every id.
static pd_status check_tokenizers(const pd_tok *t, const char *draft_dir, pd_err *err) {
    pd_tok *d = pd_tok_load(draft_dir, err);
    if (!d) return PD_ERR_INVALID;
    pd_status st = PD_OK;
    if (pd_tok_n_vocab(d) != pd_tok_n_vocab(t)) {
        st = pd_err_set(err, PD_ERR_INVALID, "--speculative-model %s: its tokenizer has %d tokens, the target's %d: they must match",
                        draft_dir, pd_tok_n_vocab(d), pd_tok_n_vocab(t));
    } else {
        for (int32_t id = 0; id < pd_tok_n_vocab(t); id++) {
            size_t la = 0, lb = 0;
            const char *a = pd_tok_token_bytes(t, id, &la), *b = pd_tok_token_bytes(d, id, &lb);
            if (la != lb || (la && (!a || !b || memcmp(a, b, la)))) {
                st = pd_err_set(err, PD_ERR_INVALID,
                                "--speculative-model %s: its tokenizer differs from the target's at token id %d: they must match",
                                draft_dir, id);
                break;
            }
        }
    }
    pd_tok_free(d);
    return st;
}

pd_status pd_engine_spec_load(pd_engine *e, pd_err *err) {
    const pd_engine_params *p = &e->params;
    if (p->spec_dummy_num_layers && (p->spec_method != PD_SPEC_DRAFT || !p->dummy_weights))
        return pd_err_set(err, PD_ERR_INVALID,
                          "--speculative-dummy-layers is a benchmark fixture for --speculative-method draft with --load-format dummy");
    if (p->spec_method == PD_SPEC_NONE || p->role == PD_ROLE_PREFILL) return PD_OK;
    if (p->spec_method < 0 || p->spec_method >= PD_SPEC_N)
        return pd_err_set(err, PD_ERR_INVALID, "unknown speculative method %d", p->spec_method);
    espec *S = pd_calloc(1, sizeof *S);
    if (!S) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    e->spec = S;
    S->method = (pd_spec_method)p->spec_method;
    S->K = p->spec_k > 0 ? p->spec_k : 4;
    if (S->K > PD_SPEC_MAX_K) return pd_err_set(err, PD_ERR_INVALID, "--num-speculative-tokens must be 1..%d", PD_SPEC_MAX_K);
    S->ngram_min = p->spec_ngram_min > 0 ? p->spec_ngram_min : 1;
    S->ngram_max = p->spec_ngram_max > 0 ? p->spec_ngram_max : 3;
    if (S->ngram_min > S->ngram_max) return pd_err_set(err, PD_ERR_INVALID, "ngram: min length %d > max %d", S->ngram_min, S->ngram_max);
    S->W = p->spec_lookahead_w > 0 ? p->spec_lookahead_w : 8;
    S->N = p->spec_lookahead_n > 0 ? p->spec_lookahead_n : 4;
    if (S->W > PD_SPEC_MAX_W || S->N < 2 || S->N > PD_SPEC_MAX_N)
        return pd_err_set(err, PD_ERR_INVALID, "lookahead: window 1..%d, n-gram size 2..%d", PD_SPEC_MAX_W, PD_SPEC_MAX_N);
    if (S->method == PD_SPEC_LOOKAHEAD) S->K = PD_MIN(S->K, S->N - 1);  // one n-gram's continuation
    S->adaptive = !p->spec_fixed;
    S->la_yield = 0.1;  // optimistic until measured: the window must run to fill the pool at all
    S->V = pd_model_get_config(e->model)->vocab_size;
    pd_spec_cost_init(&S->cost, 0);
    pd_spec_cost_init(&S->cost_eager, 0);
    pd_spec_shapes_init(&S->shapes);
    pd_spec_dcost_init(&S->dcost);
    pd_spec_dcost_init(&S->dcatch);
    pd_spec_shapes_init(&S->warm);
    const char *dbg = getenv("PD_SPEC_STATS");
    S->stats = dbg && strcmp(dbg, "0");
    // PD_SPEC_PROBE_SHARE: a share of the step time in (0, 0.1]; PD_SPEC_MIN_GAIN: a share of the step
    // rate in (0, 0.5] (A/B knobs, strict).
    if (pd_env_double("PD_SPEC_PROBE_SHARE", PROBE_SHARE, 0, 0.1, &S->probe_share, err) ||
        pd_env_double("PD_SPEC_MIN_GAIN", PD_SPEC_MIN_GAIN, 0, 0.5, &S->min_gain, err) ||
        pd_env_double("PD_SPEC_DRAIN_GAIN", PD_SPEC_DRAIN_MIN_GAIN, 0, 0.5, &S->drain_gain, err))
        return PD_ERR_INVALID;
    if (pd_env_switch("PD_SPEC_IDLE_FAST", true, &S->idle_fast, err) || pd_env_switch("PD_SPEC_PROBE_GROUP", true, &S->probe_group, err) ||
        pd_env_switch("PD_SPEC_DRAIN", true, &S->drain_on, err) || pd_env_switch("PD_SPEC_CALIB", true, &S->calib_on, err) ||
        pd_env_int("PD_SPEC_DRAIN_HOLD", 8, 0, 1 << 20, &S->drain_hold, err) || pd_env_switch("PD_SPEC_POP_REQ", true, &S->pop_req, err) ||
        pd_env_switch("PD_SPEC_CALIB_TOK", false, &S->calib_tok, err))
        return PD_ERR_INVALID;
    if (pd_env_switch("PD_SPEC_EVIDENCE", true, &S->evidence, err) ||
        pd_env_double("PD_SPEC_DRAIN_Z", PD_SPEC_DRAIN_Z, 0, 4, &S->drain_z, err) ||
        pd_env_double("PD_SPEC_PRIOR_EVIDENCE", PD_SPEC_PRIOR_EVIDENCE, 0, 64, &S->prior_ev, err) ||
        pd_env_int("PD_SPEC_EXPLORE_N", PD_SPEC_EXPLORE_N, 0, 1 << 20, &S->explore_n, err))
        return PD_ERR_INVALID;
    if (!S->evidence) {  // (every shape table back to session 14's rule: a clean A/B)
        S->drain_z = 0, S->explore_n = 0;
        S->shapes.trust_n = S->warm.trust_n = S->dcost.t.trust_n = S->dcatch.t.trust_n = 0;
    }
    pd_spec_calib_init(&S->calib);
    pd_spec_prior_init(&S->prior);
    S->quiet_until = INT64_MAX;
    S->last_drain_verdict = -1;
    S->quiet_n = -1;
    pd_spec_backoff_init(&S->probe_bo);
    pd_spec_backoff_init(&S->win_bo);
    S->prior0 = S->method == PD_SPEC_DRAFT ? 0.7 : 0.5;
    pd_spec_accept_init(&S->pop, S->prior0);
    S->win_quiet_n = -1;
    if (S->method == PD_SPEC_DRAFT) {
        if (!p->spec_model_dir) return pd_err_set(err, PD_ERR_INVALID, "--speculative-method draft needs --speculative-model DIR");
        pd_status st = check_tokenizers(e->tok, p->spec_model_dir, err);
        if (st) return st;
        pd_model_params mp = pd_model_params_default();
        mp.dir = p->spec_model_dir;
        mp.backend = e->backend;
        mp.dummy = p->dummy_weights;
        mp.seed = 7;
        if (p->spec_dummy_num_layers) {  // the fixture: the target's seed, its first K layers
            mp.seed = pd_model_params_default().seed;
            mp.dummy_num_layers = p->spec_dummy_num_layers;
        }
        S->draft = pd_model_load(&mp, err);
        if (!S->draft) return PD_ERR_INVALID;
        if (pd_model_get_config(S->draft)->vocab_size != S->V)
            return pd_err_set(err, PD_ERR_INVALID, "--speculative-model: vocab_size %d, the target's %d: they must match",
                              pd_model_get_config(S->draft)->vocab_size, S->V);
    }
    return PD_OK;
}

size_t pd_engine_spec_kv_bytes_per_block(const pd_engine *e) {
    const espec *S = e->spec;
    if (!S || !S->draft) return 0;
    return 2 * (size_t)pd_model_get_config(S->draft)->n_layers * pd_model_kv_row_bytes(S->draft) *
           (size_t)(e->params.block_size > 0 ? e->params.block_size : 16);
}

pd_status pd_engine_spec_init(pd_engine *e, pd_sched_params *sp, pd_err *err) {
    espec *S = e->spec;
    if (!S) return PD_OK;
    S->bs = e->params.block_size;
    if (S->draft) {
        // Same geometry as the target's pool: the draft's blocks are indexed by the same tables.
        S->dcache = pd_model_cache_new(S->draft, pd_model_cache_n_blocks(e->cache), S->bs, err);
        if (!S->dcache) return PD_ERR_NOMEM;
    }
    // Lookahead slots: drafts, plus the Jacobi window for lookahead decoding.
    sp->max_lookahead_slots = S->K + (S->method == PD_SPEC_LOOKAHEAD ? S->W : 0);
    // Verify steps as graphs (captured by the engine's warm-up, which runs after this); the draft's
    // forward 1 catches up 1-2 tokens per sequence in steady state.
    pd_model_set_graph_q(e->model, 1 + sp->max_lookahead_slots);
    if (S->draft) pd_model_set_graph_q(S->draft, 2);
    const char *ds = getenv("PD_DEVICE_SAMPLING");
    S->dev_sample = pd_backend_has_sample(e->backend) && !(ds && !strcmp(ds, "0"));
    S->n_scratch = omp_get_max_threads();
    S->scratch = pd_malloc(sizeof(float) * (size_t)S->n_scratch * (size_t)S->V);
    if (!S->scratch) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    PD_LOG_I("engine: speculative decoding: %s, up to %d tokens per step%s%s", pd_spec_method_name(S->method), S->K,
             S->adaptive ? ", adaptive" : ", fixed", S->draft ? " (draft model loaded)" : "");
    return PD_OK;
}

static bool step_is_graph(pd_model *m, int n_seqs, int max_q);
static uint32_t shape_key(pd_model *m, int n_seqs, int max_q, int n_tokens);

// One timed forward of b (device logits, synchronised), microseconds; < 0 on error.
static double timed_forward(pd_engine *e, pd_model *m, pd_model_cache *c, const bbuild *b) {
    pd_batch batch = bb_batch(b);
    const float *dl = NULL;
    int64_t t0 = pd_time_us();
    if (pd_model_forward_dev(m, c, &batch, &dl)) return -1;
    pd_backend_sync(e->backend);
    return (double)(pd_time_us() - t0);
}

// Warm-up timings for the policy (graphs on only: without graphs a step's cost follows its tokens
// and the live line is enough). Before any request, on KV blocks no request holds yet (their
// contents are overwritten before a request reads them; the draft's KV is only ever a speed matter).
//  - the target's verify graph shapes: B sequences of q tokens, logits at every row, at each batch
//    bucket B <= max_num_seqs and query bucket q (1 = the plain step) -> S->warm (3 runs; the table
//    drops the first)
//  - the draft's eager catch-up forwards at each padded size tok_bucket() from 3 tokens up to
//    S->catchup_max (one sequence, its last rows with logits, up to the batch bucket's count): the
//    first run builds the GEMM plans (cuBLASLt heuristics and tuning, tens of ms for a new M),
//    which a live catch-up padded to the same size then finds; the later runs seed S->dcatch.
static pd_status warm_timings(pd_engine *e, espec *S) {
    bbuild *b = &S->bb;
    int max_seqs = e->params.max_num_seqs > 0 ? e->params.max_num_seqs : 64, bs = S->bs;
    int n_blocks = pd_model_cache_n_blocks(e->cache);
    int32_t *bt = pd_malloc(sizeof(int32_t) * (size_t)n_blocks), *tok = pd_calloc((size_t)PD_MAX(S->catchup_max, 64), sizeof(int32_t));
    if (!bt || !tok) {
        pd_free(bt), pd_free(tok);
        return PD_ERR_NOMEM;
    }
    for (int i = 0; i < n_blocks; i++) bt[i] = i;
    int n_shapes = 0, n_catch = 0;
    int64_t t0 = pd_time_us();
    int qmax = 1 + S->K + (S->method == PD_SPEC_LOOKAHEAD ? S->W : 0);
    for (int n = 1, last_B = 0; n <= max_seqs; n++) {
        int B = pd_model_step_tokens(e->model, n, 1, n);
        if (B == last_B || B != n) continue;  // each batch bucket once, at its full size
        last_B = B;
        for (int q = 1, last_Q = 0; q <= qmax; q++) {
            if (!step_is_graph(e->model, B, q)) break;
            int Q = pd_model_step_tokens(e->model, B, q, B * q) / B;
            if (Q == last_Q || Q != q) continue;
            last_Q = Q;
            int nb = (q + bs - 1) / bs;
            if (B * nb > n_blocks) break;
            bb_reset(b);
            for (int i = 0; i < B; i++)
                if (!bb_add(b, tok, q, 0, bt + i * nb, bs, q)) goto oom;
            uint32_t key = shape_key(e->model, B, q, B * q);
            for (int r = 0; r < 3 && key; r++) {
                double us = timed_forward(e, e->model, e->cache, b);
                if (us < 0) goto fail;
                pd_spec_shapes_observe(&S->warm, key, us);
            }
            n_shapes++;
        }
    }
    S->warm_n = n_shapes;
    if (S->draft) {
        int lmax = tok_bucket(max_seqs);
        for (int T = 3; T <= S->catchup_max; T = tok_bucket(T + 1)) {
            if (T != tok_bucket(T)) continue;
            if ((T + bs - 1) / bs > n_blocks) break;
            bb_reset(b);
            if (!bb_add(b, tok, T, 0, bt, bs, PD_MIN(T, lmax))) goto oom;
            for (int r = 0; r < 3; r++) {
                double us = timed_forward(e, S->draft, S->dcache, b);
                if (us < 0) goto fail;
                pd_spec_dcost_observe(&S->dcatch, (uint32_t)T, us);
            }
            n_catch++;
        }
    }
    PD_LOG_I("engine: speculation: %d verify shapes and %d draft catch-up sizes timed at warm-up in %.2f s", n_shapes, n_catch,
             (double)(pd_time_us() - t0) * 1e-6);
    pd_free(bt), pd_free(tok);
    return PD_OK;
oom:
    pd_free(bt), pd_free(tok);
    return PD_ERR_NOMEM;
fail:
    pd_free(bt), pd_free(tok);
    return PD_ERR_DEVICE;
}

pd_status pd_engine_spec_warmup(pd_engine *e, pd_err *err) {
    espec *S = e->spec;
    if (!S) return PD_OK;
    int n_graphs = 0;
    int max_step = (e->params.max_num_batched_tokens > 0 ? e->params.max_num_batched_tokens : 2048) + CATCHUP_MAX;
    S->catchup_max = PD_MIN(max_step, pd_model_cache_n_blocks(e->cache) * S->bs);
    bool pad_on, warm_on;  // PD_SPEC_CATCHUP_PAD=0 / PD_SPEC_WARM_TIMINGS=0: off (A/B; the session-10 behaviour)
    if (pd_env_switch("PD_SPEC_CATCHUP_PAD", true, &pad_on, err) || pd_env_switch("PD_SPEC_WARM_TIMINGS", true, &warm_on, err))
        return PD_ERR_INVALID;
    S->catchup_pad = S->draft && step_is_graph(S->draft, 1, 1) && pad_on;
    if (S->draft) {
        pd_status st = pd_model_warmup(S->draft, S->dcache, max_step, e->params.max_num_seqs > 0 ? e->params.max_num_seqs : 64,
                                       e->max_model_len, &n_graphs);
        if (st) return pd_err_set(err, st, "draft model warm-up failed (%s)", pd_status_str(st));
        if (n_graphs > 0) PD_LOG_I("engine: draft model: %d decode graphs", n_graphs);
    }
    if (S->adaptive && step_is_graph(e->model, 1, 1) && warm_on) {
        pd_status st = warm_timings(e, S);
        if (st) return pd_err_set(err, st, "speculation warm-up timings failed (%s)", pd_status_str(st));
    }
    return PD_OK;
}

void pd_engine_spec_fini(pd_engine *e) {
    espec *S = e->spec;
    if (!S) return;
    if (S->stats) {
        PD_LOG_I("spec stats: %lld draft forwards (%.1f us each)", (long long)S->draft_n,
                 S->draft_n ? (double)S->draft_us / (double)S->draft_n : 0);
        if (S->draft)
            PD_LOG_I("spec stats: draft forwards: %lld steady (%.1f us each), %lld transient (%.1f us each, largest %lld us); "
                     "steady estimate %.1f us, the all-forwards EMA %.1f us",
                     (long long)S->dsteady_n, S->dsteady_n ? (double)S->dsteady_us / (double)S->dsteady_n : 0,
                     (long long)S->dtrans_n, S->dtrans_n ? (double)S->dtrans_us / (double)S->dtrans_n : 0,
                     (long long)S->dtrans_max, S->dcost.any_us, S->cost.draft_us);
        if (S->draft)
            PD_LOG_I("spec stats: catch-up padding: %lld tokens recomputed", (long long)S->n_pad_tok);
        for (int i = 0; S->draft && i < PD_SPEC_SHAPES; i++)
            if (S->dcatch.t.key[i])
                PD_LOG_I("spec stats: draft catch-up of %u tokens: %.1f us (%u forwards, warm-up's included)", S->dcatch.t.key[i],
                         (double)S->dcatch.t.us[i], S->dcatch.t.n[i]);
        for (int i = 0; i < S->n_host; i++)
            PD_LOG_I("spec stats: batch %u: whole steps over their warm-up forward: verify %.1f us, plain %.1f us", S->host[i].B,
                     S->host[i].v, S->host[i].p);
        for (int i = 0; i < PD_SPEC_SHAPES; i++)
            if (S->warm.key[i])
                PD_LOG_I("spec stats: warm-up shape batch %u x %u tokens: %.1f us", S->warm.key[i] >> 20, S->warm.key[i] & ((1u << 20) - 1),
                         (double)S->warm.us[i]);
        for (int i = 0; S->draft && i < PD_SPEC_SHAPES; i++)
            if (S->dcost.t.key[i])
                PD_LOG_I("spec stats: draft shape batch %u, %u tokens per row: %.1f us (%u forwards)", S->dcost.t.key[i] >> 20,
                         S->dcost.t.key[i] & ((1u << 20) - 1), (double)S->dcost.t.us[i], S->dcost.t.n[i]);
        PD_LOG_I("spec stats: %lld steps, %lld verify (%.1f us each, forward), %lld plain (%.1f us each, whole step), "
                 "%lld probe steps (%lld made the policy draft; backoff x%u; %lld due ones skipped: no gain even at acceptance 1), "
                 "%lld window steps, %lld window probes (backoff x%u); "
                 "host time in the hooks besides forwards: %.2f us per plain step, %.1f us per verify step; %lld idle fast-path steps",
                 (long long)S->n_steps, (long long)S->verify_n, S->verify_n ? (double)S->verify_us / (double)S->verify_n : 0,
                 (long long)S->plain_n, S->plain_n ? (double)S->plain_us / (double)S->plain_n : 0, (long long)S->n_probes,
                 (long long)S->n_probe_ok, S->probe_bo.mult, (long long)S->n_probe_skip, (long long)S->n_win_steps, (long long)S->n_win_probes, S->win_bo.mult,
                 S->plain_n ? (double)S->hook_plain_us / (double)S->plain_n : 0,
                 S->verify_n ? (double)S->hook_us / (double)S->verify_n : 0, (long long)S->n_fast);
        PD_LOG_I("spec stats: drain model%s: %lld drafting steps judged while draining, %lld refused (%lld of them at the acceptance's "
                 "lower bound only, z %.2f), %lld capped; %lld probes skipped; explore cap %d steps%s",
                 S->drain_on ? "" : " (off)", (long long)S->n_drain_eval, (long long)S->n_drain_refused, (long long)S->n_drain_lb_refused,
                 S->drain_z, (long long)S->n_drain_capped, (long long)S->n_drain_probe_skip, S->explore_n,
                 S->evidence ? "" : " (PD_SPEC_EVIDENCE=0: session 14's policy)");
        PD_LOG_I("spec stats: new-request prior: finished requests' lifetime acceptance %.3f over %lld requests%s; the engine's "
                 "recent acceptance %.3f",
                 pd_spec_prior_get(&S->prior), (long long)S->prior.n, S->pop_req ? "" : " (PD_SPEC_POP_REQ=0: not used)",
                 pd_spec_accept_alpha(&S->pop));
        for (int i = 0; i < S->n_bst; i++) {
            const bstat *b = &S->bst[i];
            PD_LOG_I("spec stats: batch %u: %lld steps judged, %lld drafted by the policy, %lld refused by the step model, %lld refused "
                     "and %lld capped by the drain model (predicted finish-time ratio %.3f..%.3f), %lld drain refusals judged again, "
                     "%lld fast-path steps; realized-gain factor %.3f over %lld drafting steps (emitted / expected tokens %.3f, predicted / realized time %.3f)%s",
                     b->B, (long long)b->judged, (long long)b->drafted, (long long)b->step_refused, (long long)b->drain_refused,
                     (long long)b->drain_capped, b->drain_ratio_max < 0 ? 0 : b->drain_ratio_min, b->drain_ratio_max < 0 ? 0 : b->drain_ratio_max,
                     (long long)b->rejudged, (long long)b->fast, pd_spec_calib_factor(&S->calib, b->B), (long long)pd_spec_calib_n(&S->calib, b->B),
                     pd_spec_calib_part(&S->calib, b->B, 0), pd_spec_calib_part(&S->calib, b->B, 1), S->calib_on ? "" : " (PD_SPEC_CALIB=0: not applied)");
        }
        for (int i = 0; i < PD_SPEC_SHAPES; i++)
            if (S->shapes.key[i])
                PD_LOG_I("spec stats: shape batch %u x %s%u tokens: %.1f us (%u steps)", (S->shapes.key[i] & ~SHAPE_EAGER) >> 20,
                         S->shapes.key[i] & SHAPE_EAGER ? "eager <= " : "", S->shapes.key[i] & ((1u << 20) - 1),
                         (double)S->shapes.us[i], S->shapes.n[i]);
    }
    pd_model_cache_free(S->dcache);
    pd_model_free(S->draft);
    bbuild *b = &S->bb;
    pd_free(b->tok), pd_free(b->qi), pd_free(b->kvl), pd_free(b->bti), pd_free(b->bt), pd_free(b->lr);
    pd_free(S->logits), pd_free(S->scratch), pd_free(S->qbuf), pd_free(S->results), pd_free(S->drows), pd_free(S->douts);
    pd_free(S->kmax), pd_free(S->kch), pd_free(S->sidx), pd_free(S->row0), pd_free(S->alpha), pd_free(S->srs);
    pd_free(S->dR), pd_free(S->dK), pd_free(S->dA), pd_free(S->dL), pd_free(S->dE), pd_free(S->dU);
    pd_free(S);
    e->spec = NULL;
}

pd_status pd_engine_spec_req_init(pd_engine *e, ereq *q, const pd_engine_request *r) {
    espec *S = e->spec;
    if (!S) return PD_OK;
    sreq *sr = pd_calloc(1, sizeof *sr);
    if (!sr) return PD_ERR_NOMEM;
    q->spec = sr;
    sr->draft_pos = -1;
    sr->owner = S;
    sr->last_k = -1;  // busy until its first decode step chose
    sr->ng_src = sr->ng_hint = -1;
    S->n_busy++;
    sr->la_want = -1;
    sr->n_prompt = r->n_prompt;
    sr->is_random = r->sampling.temperature > 0;
    sr->fixed_k = sr->is_random && r->sampling.has_seed;
    sr->max_tokens = r->max_tokens;
    for (int i = 0; i < r->n_prompt; i++)
        if (!sreq_push(sr, r->prompt[i])) return PD_ERR_NOMEM;
    double prior = S->prior0;
    double pr = S->pop_req ? pd_spec_prior_get(&S->prior) : -1;
    if (pr >= 0) prior = pr;
    else if (S->pop_n >= POP_MIN) prior = pd_spec_accept_alpha(&S->pop);
    sr->informed = pr >= 0 || S->pop_n >= POP_MIN;
    // (Held with weight 2, as a fixed prior. Weight 8 — session 12, against lucky probe accepts —
    // cut the paying draft fixture at batch 64 from 1.07-1.08x to 1.00-1.05x: calls spec12-3/4.)
    pd_spec_accept_init(&sr->acc, prior);
    if (S->method == PD_SPEC_LOOKAHEAD) {
        sr->pool = pd_spec_pool_new(S->N);
        if (!sr->pool) return PD_ERR_NOMEM;
        pd_spec_jacobi_init(&sr->jac, S->W, S->N, r->prompt, r->n_prompt);
    }
    pd_status st = pd_sched_set_lookahead(e->sched, r->id, S->K + (S->method == PD_SPEC_LOOKAHEAD ? S->W : 0));
    return st == PD_ERR_NOTFOUND ? PD_OK : st;
}

void pd_engine_spec_req_fini(ereq *q) {
    sreq *sr = q->spec;
    if (!sr) return;
    if (sr->owner && is_busy(sr, sr->last_k)) sr->owner->n_busy--;
    if (sr->owner && !sr->fixed_k) pd_spec_prior_add(&sr->owner->prior, sr->n_steps, sr->n_accepted, sr->n_fail);
    pd_free(sr->toks);
    pd_spec_pool_free(sr->pool);
    pd_free(sr);
    q->spec = NULL;
}

// ---- the step ------------------------------------------------------------------------------------

static bool is_decode(const pd_step_seq *s, const sreq *sr) {
    return s->needs_logits && s->n_tokens == 1 && sr && s->pos_start == sr->n - 1;
}

// The key of a draft forward's shape in S->dcost: its batch bucket (the draft's graph bucket, else
// its rows) and query length q (1: forwards 2..k; 2: forward 1's steady catch-up of the last token
// and, after a fully accepted step, the bonus token).
static uint32_t draft_key(pd_model *draft, int n_seqs, int q) {
    int B = pd_model_step_tokens(draft, n_seqs, 1, n_seqs);
    if (B < 1) B = n_seqs;
    return B < 1 || B >= (1 << 11) ? 0 : (uint32_t)B << 20 | (uint32_t)q;
}

// One draft forward of b (its longest row max_q tokens) took dt. Steady forwards (every row 1-2
// tokens, every row with logits) price drafting; transients (a catch-up after idle steps, prefill
// chunks mirrored, on the GPU an eager forward) do not: they come once, and up to tens of times
// dearer (spec.h pd_spec_dcost). Every forward still counts in the old all-forwards EMA
// (S->cost.draft_us, PD_SPEC_STATS only), to show what it would have priced.
static void draft_observe(espec *S, const bbuild *b, int max_q, int64_t dt) {
    pd_spec_cost_observe_draft(&S->cost, (double)dt);
    bool steady = max_q <= 2 && b->nl == b->ns;
    if (steady) {
        uint32_t key = draft_key(S->draft, b->ns, max_q);
        if (S->stats && S->n_dtrans_logged < DRAFT_LOG_MAX && pd_spec_shapes_get_n(&S->dcost.t, key) == 0) {
            S->n_dtrans_logged++;  // the shape's first forward (a graph's first launch): not a sample
            PD_LOG_I("spec stats: first draft forward of shape batch %u, %d tokens per row at step %lld: %lld us "
                     "(steady estimate %.1f us; the all-forwards EMA now %.1f us)",
                     key >> 20, max_q, (long long)S->n_steps, (long long)dt, S->dcost.any_us, S->cost.draft_us);
        }
        pd_spec_dcost_observe(&S->dcost, key, (double)dt);
        S->dsteady_n++, S->dsteady_us += dt;
        return;
    }
    S->dtrans_n++, S->dtrans_us += dt;
    S->dtrans_max = PD_MAX(S->dtrans_max, dt);
    if (S->stats && S->n_dtrans_logged < DRAFT_LOG_MAX) {
        S->n_dtrans_logged++;
        PD_LOG_I("spec stats: transient draft forward at step %lld: %d rows, %d tokens (longest %d), %d logits: %lld us "
                 "(steady estimate %.1f us; the all-forwards EMA now %.1f us)",
                 (long long)S->n_steps, b->ns, b->nt, max_q, b->nl, (long long)dt, S->dcost.any_us, S->cost.draft_us);
    }
}

// What drafting costs in a step of n drafting sequences (the candidates: an upper bound) whose
// draft KV lags the target by lag tokens in all (the catch-up through each one's last token: 1-2
// a sequence in steady state), the longest lag max_lag. A row of more than 2 tokens makes forward
// 1 an eager catch-up, priced at the measured (warm-up seeded) catch-up forward of its padded
// size; an unmeasured size at the steady forward scaled by its tokens (2 a row in steady state).
static pd_spec_draft_price draft_price(const espec *S, int n, int lag, int max_lag) {
    pd_spec_draft_price p = {pd_spec_dcost_get(&S->dcost, draft_key(S->draft, n, 2)),
                             pd_spec_dcost_get(&S->dcost, draft_key(S->draft, n, 1))};
    if (p.first_us < 0) p.first_us = 0;  // nothing measured yet: drafting runs and gets measured
    if (p.next_us < 0) p.next_us = 0;
    p.first_us = pd_spec_catchup_us(&S->dcatch, S->catchup_max, p.first_us, n, lag, max_lag);
    return p;
}

// Draft forwards: catch-up (and mirrored prefill chunks) + draft token 1, then one token per
// forward. Fills sr->draft[0..k) (and q rows for random sampling). On error drafts nothing.
static pd_status run_draft(pd_engine *e, const pd_step_plan *plan, sreq **srs) {
    espec *S = e->spec;
    bbuild *b = &S->bb;
    int V = S->V, max_k = 0, n_rand = 0, max_q = 1;  // max_q: forward 1's longest row
    int donor = -1, donor_from = 0;  // the sequence with the longest valid draft KV (padding, below)
    bb_reset(b);
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        sreq *sr = srs[i];
        if (!sr) continue;
        int end = s->pos_start + s->n_tokens;  // positions the target has after this step
        int from = sr->draft_pos;
        if (from > donor_from) donor = i, donor_from = from;
        // On a GPU forward 1 stays within the tokens its workspace and padded sizes were made for
        // (S->catchup_max): a drafting row whose catch-up does not fit drafts nothing this step,
        // other rows catch up what fits (an eager forward past them grew the workspace or built
        // plans: up to 90 ms, session 11 call 3).
        int room = S->catchup_pad ? S->catchup_max - b->nt : INT_MAX;
        if (S->kch[i] > 0 && end - from > room) S->kch[i] = 0;
        if (S->kch[i] > 0) {
            // Catch-up through the last real token; its logits give draft 1.
            if (!bb_add(b, sr->toks + from, end - from, from, s->block_ids, S->bs, 1)) return PD_ERR_NOMEM;
            max_q = PD_MAX(max_q, end - from);
            S->row0[i] = b->nl - 1;
            max_k = PD_MAX(max_k, S->kch[i]);
            if (sr->is_random) n_rand += S->kch[i];
        } else {
            // A prefill chunk: the draft keeps up with the target (chunked like it). A decode far
            // behind (a remote prefill's prompt) catches up CATCHUP_MAX tokens a step; a decode
            // a little behind catches up when it next drafts.
            int lim = is_decode(s, sr) ? (end - from > CATCHUP_MAX ? CATCHUP_MAX : 0) : PD_MIN(end - from, CATCHUP_MAX);
            lim = PD_MIN(lim, room);
            S->row0[i] = -1;
            if (lim > 0) {
                if (!bb_add(b, sr->toks + from, lim, from, s->block_ids, S->bs, 0)) return PD_ERR_NOMEM;
                max_q = PD_MAX(max_q, lim);
                sr->draft_pos = from + lim;
            }
        }
    }
    if (b->ns == 0) return PD_OK;
    // An eager forward 1 (a catch-up of more than 2 tokens in some row) is padded to tok_bucket()
    // tokens and logit rows by recomputing the start of the donor's valid draft KV (positions
    // [0, pad) again, same tokens: the same KV up to rounding, and the draft's KV is only ever a
    // speed matter), so catch-ups come in a few sizes whose GEMM plans the warm-up built and timed
    // (an unpadded catch-up of a new size built its plans live: 12-50 ms). The padding's logit
    // rows come after every real one and are ignored.
    int pad_tok = 0;
    if (max_q > 2 && S->catchup_pad && donor >= 0) {
        int T = tok_bucket(b->nt), L = b->nl > 0 ? tok_bucket(b->nl) : 0;  // (a prefill mirror has no logits)
        if (L > T - b->nt + b->nl) T = tok_bucket(b->nt + (L - b->nl));
        int pad = T - b->nt, pad_l = PD_MIN(L - b->nl, pad);
        if (pad > 0 && T <= S->catchup_max && pad <= donor_from) {
            if (!bb_add(b, srs[donor]->toks, pad, 0, plan->seqs[donor].block_ids, S->bs, pad_l)) return PD_ERR_NOMEM;
            pad_tok = pad;
        }
    }
    if (n_rand > 0 && pd_array_reserve(&S->qbuf, sizeof(float) * (size_t)V, &S->cap_q, (size_t)n_rand)) return PD_ERR_NOMEM;
    // Greedy drafts of requests the device may check: argmax on the device, no logits download.
    bool dev = S->dev_sample;
    for (int i = 0; dev && i < plan->n_seqs; i++)
        if (srs[i] && S->kch[i] > 0) dev = dev_greedy(pd_engine_req_find(e, plan->seqs[i].req_id)->sampler);
    int qoff = 0;
    for (int i = 0; i < plan->n_seqs; i++) {
        sreq *sr = srs[i];
        if (!sr || S->kch[i] <= 0) continue;
        sr->q = sr->is_random ? S->qbuf + (size_t)qoff * (size_t)V : NULL;
        if (sr->is_random) qoff += S->kch[i];
    }
    for (int j = 0; j < PD_MAX(max_k, 1); j++) {
        if (j > 0) {
            bb_reset(b);
            for (int i = 0; i < plan->n_seqs; i++) {
                sreq *sr = srs[i];
                if (!sr || S->kch[i] <= j) continue;
                const pd_step_seq *s = &plan->seqs[i];
                if (!bb_add(b, &sr->draft[j - 1], 1, s->pos_start + j, s->block_ids, S->bs, 1)) return PD_ERR_NOMEM;
                S->row0[i] = b->nl - 1;
            }
        }
        pd_batch batch = bb_batch(b);
        int64_t t0 = pd_time_us();  // (the batch building above is host work of the draft too: small)
        pd_status st;
        if (dev && b->nl > 0) {
            const float *dl = NULL;
            st = pd_model_forward_dev(S->draft, S->dcache, &batch, &dl);
            if (st) return st;
            if (!reserve_drows(S, b->nl)) return PD_ERR_NOMEM;
            for (int r = 0; r < b->nl; r++)
                S->drows[r] = (pd_sample_row){.temperature = 0, .top_p = 1.0f, .repetition_penalty = 1.0f, .n_logprobs = -1,
                                              .mask_row = -1};
            pd_sample_params sp = {.logits = (float *)dl, .n_rows = b->nl, .vocab = V, .rows = S->drows, .out = S->douts};
            pd_op_sample(e->backend, &sp);
        } else {
            if (!reserve_logits(S, PD_MAX(b->nl, 1))) return PD_ERR_NOMEM;
            st = pd_model_forward(S->draft, S->dcache, &batch, S->logits);
            if (st) return st;
        }
        int64_t dt = pd_time_us() - t0;
        if (b->nl > 0) draft_observe(S, b, j == 0 ? max_q : 1, dt);
        if (j == 0 && max_q > 2 && b->nl > 0 && S->catchup_max > 0) pd_spec_dcost_observe(&S->dcatch, (uint32_t)tok_bucket(b->nt), (double)dt);
        S->n_pad_tok += pad_tok;
        pad_tok = 0;
        S->draft_us += dt;
        S->step_draft_us += dt;
        S->draft_n++;
        for (int i = 0; i < plan->n_seqs; i++) {
            sreq *sr = srs[i];
            if (!sr || S->kch[i] <= j) continue;
            ereq *r = pd_engine_req_find(e, plan->seqs[i].req_id);
            if (dev) {
                sr->draft[j] = S->douts[S->row0[i]].token;
            } else {
                float *qrow = sr->q ? sr->q + (size_t)j * (size_t)V : S->scratch;
                sr->draft[j] = pd_sampler_draft(r->sampler, S->logits + (size_t)S->row0[i] * (size_t)V, j, qrow);
            }
            sr->k = j + 1;
            sr->draft_pos = plan->seqs[i].pos_start + j + 1;
        }
    }
    return PD_OK;
}

// Proposals without a draft model, up to kmax[i] tokens; sets kmax[i] to what is available.
static void propose_free(pd_engine *e, const pd_step_plan *plan, sreq **srs) {
    espec *S = e->spec;
    for (int i = 0; i < plan->n_seqs; i++) {
        sreq *sr = srs[i];
        if (!sr || S->kmax[i] <= 0) continue;
        int m = 0;
        if (S->method == PD_SPEC_NGRAM)
            m = pd_spec_ngram_propose_at(sr->toks, sr->n, S->ngram_min, S->ngram_max, S->kmax[i], sr->ng_hint, sr->draft,
                                         &sr->ng_src);
        else
            m = pd_spec_pool_propose(sr->pool, sr->toks[sr->n - 1], S->kmax[i], sr->draft);
        S->kmax[i] = m;
    }
}

// Whether a step of n_seqs sequences, the longest of max_q tokens, runs as a graph
// (pd_model_step_tokens gives a graph step's padded size, else the tokens passed: here 0).
static bool step_is_graph(pd_model *m, int n_seqs, int max_q) { return pd_model_step_tokens(m, n_seqs, max_q, 0) > 0; }

// A step's shape for the measured-cost table, for steps of up to SHAPE_MAX_Q query tokens per
// sequence (decodes and verify steps) on a model with graphs (0: not kept: a step with a long
// prefill chunk, or no graphs at all, where a step's cost follows its tokens and the line is
// enough). A graph step: its batch bucket and padded tokens B x Q. An eager step: the batch
// bucket and its tokens rounded up to 1, 2, 3, 4, 6, 8, 12, ... (powers of two and their 1.5x),
// flagged apart from graphs: eager steps of similar size share an entry, so one measurement
// covers them (an eager verify step of a small model costs several plain steps, and the first of
// each size far more: cuBLASLt plans for new shapes).
static uint32_t shape_key(pd_model *m, int n_seqs, int max_q, int n_tokens) {
    if (n_seqs < 1 || max_q < 1 || max_q > SHAPE_MAX_Q || !step_is_graph(m, 1, 1)) return 0;
    int B = pd_model_step_tokens(m, n_seqs, 1, n_seqs), T = pd_model_step_tokens(m, n_seqs, max_q, n_tokens);
    if (B < 1 || B >= (1 << 11) || T < 1 || T >= (1 << 19)) return 0;
    uint32_t eager = 0;
    if (!step_is_graph(m, n_seqs, max_q)) {
        T = tok_bucket(T), eager = SHAPE_EAGER;
    }
    return eager | (uint32_t)B << 20 | (uint32_t)T;
}

// The step's cost for the policy (pd_spec_step_cost_fn): all of the plan's sequences, the longest
// query being the drafts' (1 + max_k) or another sequence's (a prefill chunk). Measured when this
// shape was timed before; else the line at the padded size, the graph steps' line or the eager
// steps' (an eager step of 72 tokens costs several graph steps of 64 on a small model): both are
// optimistic for a shape never run, so it gets tried once, and then it is measured.
#define COST_NEVER 1e12  // a shape the adaptive policy does not go to

// The host-overhead slot of a graph shape's batch bucket (NULL: none, or no room).
static double *host_slot(espec *S, uint32_t key, bool add) {
    if (!key || (key & SHAPE_EAGER)) return NULL;
    uint32_t B = key >> 20, T = key & ((1u << 20) - 1);
    bool verify = B > 0 && T > B;
    for (int i = 0; i < S->n_host; i++)
        if (S->host[i].B == B) return verify ? &S->host[i].v : &S->host[i].p;
    if (!add || S->n_host >= (int)PD_ARRAY_LEN(S->host)) return NULL;
    S->host[S->n_host] = (host_ov){.B = B, .v = -1, .p = -1};
    return verify ? &S->host[S->n_host++].v : &S->host[S->n_host++].p;
}

static double host_of(espec *S, uint32_t key) {
    double *h = host_slot(S, key, false);
    return h ? *h : -1;
}

// A whole step of a warm-timed shape took us: what it cost beyond its warm-up forward.
static void host_observe(espec *S, uint32_t key, double us) {
    double w = pd_spec_shapes_get(&S->warm, key);
    double *h = w > 0 ? host_slot(S, key, true) : NULL;
    if (!h) return;
    double d = PD_MAX(us - w, 0);
    *h = *h >= 0 ? 0.8 * *h + 0.2 * d : d;
}

typedef struct pad_ctx {
    espec *S;
    pd_model *m;
    int n_seqs, base_max_q;
} pad_ctx;


static double step_cost(void *ud, int max_k, int n_tokens) {
    const pad_ctx *p = ud;
    // A step with a prefill chunk runs eagerly with or without drafts; drafts change its GEMM
    // sizes (a plain engine's mixed steps have the sizes of their chunks), and a size seen for the
    // first time builds its plans on the spot (session 11: mixed steps at batch 32-64 took 13-50
    // ms with drafts). With the warm-up timings (adaptive, graphs), such steps do not draft.
    if (max_k > 0 && p->base_max_q > 1 && p->S->warm_n > 0) return COST_NEVER;
    int q = PD_MAX(p->base_max_q, 1 + max_k);
    uint32_t key = shape_key(p->m, p->n_seqs, q, n_tokens);
    bool graph = step_is_graph(p->m, p->n_seqs, q);
    double us;
    if (graph && p->base_max_q == 1) {
        // The live time; not timed live yet (or, session 15, timed fewer than PD_SPEC_SHAPE_TRUST
        // times and above it): the live plain step at this batch plus what the warm-up measured
        // between the two graphs (the step's host work is the same for both).
        us = pd_spec_shape_us(&p->S->shapes, &p->S->warm, key, shape_key(p->m, p->n_seqs, 1, p->n_seqs), host_of(p->S, key));
        if (us > 0) return us;
    } else {
        us = pd_spec_shapes_get(&p->S->shapes, key);
        if (us > 0) return us;
    }
    // A step that would replay a graph without drafts does not leave graphs for them when the
    // warm-up timed the graphs (adaptive): an eager step of the same batch costs several graph
    // steps, and its first run of a new size far more (GEMM plans).
    if (!graph && p->S->warm_n > 0 && step_is_graph(p->m, p->n_seqs, p->base_max_q)) return COST_NEVER;
    int T = pd_model_step_tokens(p->m, p->n_seqs, q, n_tokens);
    return pd_spec_cost_predict(graph ? &p->S->cost : &p->S->cost_eager, T);
}

static pad_ctx pad_of(pd_engine *e, const pd_step_plan *plan) {
    pad_ctx p = {.S = e->spec, .m = e->model, .n_seqs = plan->n_seqs, .base_max_q = 1};
    for (int i = 0; i < plan->n_seqs; i++)
        p.base_max_q = PD_MAX(p.base_max_q, plan->seqs[i].n_tokens);  // decodes: 1 (lookahead slots are not tokens)
    return p;
}

// Whether a draft forward 1 over these catch-ups (tokens in all, rows with logits, the longest
// row max_lag) runs at a size the warm-up planned: steady (rows of 1-2 tokens: a graph), or padded
// to a tok_bucket() size within S->catchup_max by recomputing up to max_from positions of a
// sequence's valid draft KV (run_draft's padding rule).
static bool catchup_fits(const espec *S, int tokens, int rows, int max_lag, int max_from) {
    if (max_lag <= 2 || !S->catchup_pad) return true;
    int T = tok_bucket(tokens), L = tok_bucket(rows);
    if (L - rows > T - tokens) T = tok_bucket(tokens + (L - rows));
    return T <= S->catchup_max && T - tokens <= max_from;
}

// The candidates of a due probe step that probe (S->kch[i] = 1), in turn from S->probe_rot: all
// of them (probe_group), else one. The draft method's probes: the longest run of candidates in
// turn whose catch-ups make a forward 1 of a planned size (catchup_fits: an unplanned size builds
// its GEMM plans on the spot, tens of ms); *lag_sum / *lag_max their catch-up. Returns how many
// probe (the first candidate always, as a single-sequence probe would).
static int pick_probes(espec *S, const pd_step_plan *plan, sreq **srs, int n, int *lag_sum, int *lag_max) {
    int want = S->probe_group ? PD_MIN(n, PROBE_SCAN) : 1;
    int64_t r0 = S->probe_rot++;
    int m = 0, best = 0, sum = 0, mx = 0, from = 0, best_sum = 0, best_mx = 0, first = -1;
    int order[PROBE_SCAN];
    for (int t = -1; t < n && m < want; t++) {
        // Single-sequence probes of a draft-free method: the idle sequence looked up for this probe first.
        int i = t >= 0 ? S->sidx[(int)((r0 + t) % n)] : !S->probe_group && S->probe_pick >= 0 && S->kmax[S->probe_pick] > 0 ? S->probe_pick : -1;
        if (i < 0 || S->kch[i] != 0 || (t >= 0 && i == first)) continue;
        if (t < 0) first = i;
        int lag = 1;
        if (S->method == PD_SPEC_DRAFT) {
            lag = PD_MAX(plan->seqs[i].pos_start + 1 - PD_MAX(srs[i]->draft_pos, 0), 1);
            from = PD_MAX(from, PD_MAX(srs[i]->draft_pos, 0));
        }
        order[m++] = i;
        sum += lag, mx = PD_MAX(mx, lag);
        if (m == 1 || S->method != PD_SPEC_DRAFT || catchup_fits(S, sum, m, mx, from)) best = m, best_sum = sum, best_mx = mx;
    }
    for (int j = 0; j < best; j++) S->kch[order[j]] = 1;
    *lag_sum = best_sum, *lag_max = best_mx;
    return best;
}

// A request's remaining budget: max_tokens - generated, and the context's room (an upper bound: EOS
// and stop strings may end it sooner).
static int remaining(const pd_engine *e, const sreq *sr) {
    int r = sr->max_tokens - (sr->n - sr->n_prompt), ctx = pd_engine_max_model_len(e) - sr->n;
    r = PD_MIN(r, ctx);
    return PD_MAX(r, 0);
}

// The drain model over the step's sequences (spec.h pd_spec_drain_choose): k (per plan seq; the
// per-step choice, capped in place) for the candidates of sidx[0..n) at the mean of their
// acceptance estimates alpha (NULL: 1, the most a probe can show), the others of the batch plain (their budgets count); fixed-length
// sequences (seeded sampling) stay out. Returns the chosen cap (0: refused).
static int drain_apply(pd_engine *e, const pd_step_plan *plan, sreq **srs, int n, const double *alpha, int *k, const pad_ctx *pc,
                       int n_base, const pd_spec_draft_price *dp, double factor, double *ratio_out) {
    espec *S = e->spec;
    int nd = 0, M = 0;
    // One acceptance for every candidate: the mean of their estimates. The batch's end is a maximum
    // over its sequences, and a maximum over noisy per-request estimates (~0.08 apart after a
    // 48-token request's verify steps) picks the unluckiest one: with them, a simulated batch of 32
    // at a true 0.5 never drafted (0.997x of plain; pooled 1.15x, drafting always 1.15x; session 13
    // call 1: the paying fixture fell from 1.12-1.27x to 1.00-1.06x at batch 32, 1.03-1.08x to
    // 0.99x at 64). The spread of real progress is the model's own variance term.
    double pool = 0;
    for (int j = 0; j < n; j++) pool += alpha ? alpha[j] : 1.0;
    pool = n > 0 ? pool / n : 0;
    // Session 15 (spec.h "a decision to draft needs evidence"; not for a probe's "at acceptance 1"):
    // an uninformed candidate counts at its own lifetime counts (pd_spec_uninformed_alpha), and the
    // verdict needs the pooled acceptance's lower bound to pay as well (pd_spec_pooled_bound).
    double lo = -1;
    if (alpha && S->evidence) {
        int64_t ua = 0, uf = 0;
        int nu = 0;
        for (int j = 0; j < n; j++) {
            const sreq *sr = srs[S->sidx[j]];
            if (!sr->informed) ua += sr->n_accepted, uf += sr->n_fail, nu++;
        }
        double au = pd_spec_uninformed_alpha(ua, uf, S->prior0);
        for (int j = 0; j < n; j++) {
            const sreq *sr = srs[S->sidx[j]];
            S->dU[j] = sr->informed ? alpha[j] : au;
            S->dE[j] = sr->informed ? pd_spec_accept_evidence(&sr->acc, S->prior_ev) : (double)(ua + uf) / nu;
        }
        double lb = pd_spec_pooled_bound(n, S->dU, S->dE, S->drain_z, &pool);
        if (S->drain_z > 0) lo = lb;
    }
    // ... corrected by what this batch bucket's drafting steps emitted against what their estimates
    // expected (spec.h pd_spec_calib_tokens; not for a probe's "at acceptance 1").
    double tokf = alpha && S->calib_on && S->calib_tok ? pd_spec_calib_tokens(&S->calib, batch_bucket(e->model, plan->n_seqs)) : 1;
    pool *= tokf;
    // sidx is in plan order: one walk pairs the candidates with their plan seqs.
    for (int i = 0, j = 0; i < plan->n_seqs; i++) {
        bool cand = j < n && S->sidx[j] == i;
        if (srs[i] && !srs[i]->fixed_k) {
            S->dR[nd] = remaining(e, srs[i]);
            S->dK[nd] = cand ? k[i] : 0;
            S->dA[nd] = cand ? pool : 0;
            S->dL[nd] = cand ? lo * tokf : 0;
            M = PD_MAX(M, S->dK[nd]);
            nd++;
        }
        j += cand;
    }
    if (M <= 0) return 0;
    double cost[PD_SPEC_MAX_K + 1];
    for (int m = 0; m <= M; m++) {
        int n_tok = n_base;
        for (int j = 0; j < n; j++) n_tok += PD_MIN(k[S->sidx[j]], m);
        cost[m] = step_cost((void *)pc, m, n_tok) + (m > 0 && dp ? dp->first_us + (m - 1) * dp->next_us : 0);
    }
    double ratio = 1, ratio_lo = 1;
    int got = pd_spec_drain_choose_lb(nd, S->dR, S->dA, lo >= 0 ? S->dL : NULL, S->dK, cost, S->drain_gain, factor, &ratio, &ratio_lo);
    if (ratio_out) *ratio_out = ratio;
    bool lb_refused = got == 0 && lo >= 0 && factor * 1 >= (1 + S->drain_gain) * ratio;  // the point estimate alone drafts
    S->n_drain_lb_refused += lb_refused;
    // PD_SPEC_STATS: the decisions where the verdict or the batch changes (why each refusal happened:
    // the pooled acceptance, the longest budget, the prices and the predicted finish-time ratio).
    int verdict = got > 0;
    if (S->stats && alpha && (verdict != S->last_drain_verdict || S->last_drain_n != plan->n_seqs)) {
        if (S->n_drain_logged < DRAIN_LOG_MAX) {
            S->n_drain_logged++;
            int rmax = 0;
            for (int j = 0; j < nd; j++) rmax = PD_MAX(rmax, S->dR[j]);
            PD_LOG_I("spec stats: drain at step %lld: batch %d, %d drafting, longest budget %d, pooled acceptance %.3f (bound %.3f), "
                     "plain %.0f us, k=1 %.0f us, k=%d %.0f us, factor %.3f (tokens %.3f): predicted finish-time ratio %.3f (at the bound "
                     "%.3f) -> %s (cap %d)",
                     (long long)S->n_steps, plan->n_seqs, n, rmax, pool, lo, cost[0], M >= 1 ? cost[1] : 0, M, cost[M], factor, tokf, ratio,
                     ratio_lo, got > 0 ? "draft" : lb_refused ? "refused at the bound" : "refused", got);
        }
        S->last_drain_verdict = verdict;
        S->last_drain_n = plan->n_seqs;
    }
    for (int i = 0, j = 0, r = 0; i < plan->n_seqs; i++) {
        bool cand = j < n && S->sidx[j] == i;
        if (srs[i] && !srs[i]->fixed_k) {
            if (cand) k[i] = S->dK[r];
            r++;
        }
        j += cand;
    }
    return got;
}

// Whether the drain model would let the candidates draft were every acceptance 1 (k = kmax: the
// most a probe could reveal), for a due probe in a draining batch.
static bool drain_probe_worth(pd_engine *e, const pd_step_plan *plan, sreq **srs, int n, const int *km, const pad_ctx *pc, int n_base,
                              const pd_spec_draft_price *dp) {
    espec *S = e->spec;
    int *k = S->kch;  // (all 0 here: no candidate drafts this step; restored below)
    for (int j = 0; j < n; j++) k[S->sidx[j]] = km[j];
    int m = drain_apply(e, plan, srs, n, NULL, k, pc, n_base, dp, 1, NULL);
    for (int j = 0; j < n; j++) k[S->sidx[j]] = 0;
    return m > 0;
}

// Chooses each speculating sequence's length in S->kch from S->kmax.
static void choose_lengths(pd_engine *e, const pd_step_plan *plan, sreq **srs) {
    espec *S = e->spec;
    int n = 0, n_base = 0, n_yield = 0;  // n_yield: sequences that get a token this step anyway
    int lag_sum = 0, lag_max = 0;        // draft: the candidates' catch-up (draft_price)
    for (int i = 0; i < plan->n_seqs; i++) {
        n_base += plan->seqs[i].n_tokens;
        n_yield += plan->seqs[i].needs_logits;
        S->kch[i] = 0;
        sreq *sr = srs[i];
        if (!sr || S->kmax[i] <= 0) continue;
        if (!S->adaptive || sr->fixed_k) {
            S->kch[i] = S->kmax[i];
            continue;
        }
        S->sidx[n] = i;
        S->alpha[n] = pd_spec_accept_alpha(&sr->acc);
        n++;
        if (S->method == PD_SPEC_DRAFT) {
            int lag = PD_MAX(plan->seqs[i].pos_start + 1 - PD_MAX(sr->draft_pos, 0), 1);
            lag_sum += lag, lag_max = PD_MAX(lag_max, lag);
        }
    }
    bool due = S->n_steps >= S->next_probe;
    if (n == 0) {
        if (S->probe_wait) pd_spec_backoff_result(&S->probe_bo, false), S->probe_wait = false;  // no proposal: no draft
        // A probe was due but no idle sequence had anything to propose (an empty lookahead pool, no
        // n-gram match): they look again PD_SPEC_PERIOD_MIN steps later (lookups are host work
        // only; a single-sequence probe lets the next sequence try PROBE_RETRY steps later).
        if (due && S->probe_look) S->next_probe = S->n_steps + (S->probe_group ? PD_SPEC_PERIOD_MIN : PROBE_RETRY);
        return;
    }
    // Compact arrays for pd_spec_choose (kmax / alpha by position in sidx).
    int *km = S->row0, *kk = S->kch + 0;  // row0 is free until the draft runs
    for (int j = 0; j < n; j++) km[j] = S->kmax[S->sidx[j]];
    int tmp[256];
    int *kout = n <= 256 ? tmp : NULL;
    if (!kout) kout = pd_malloc(sizeof(int) * (size_t)n);
    if (!kout) return;
    pad_ctx pc = pad_of(e, plan);
    pd_spec_draft_price dp = S->method == PD_SPEC_DRAFT ? draft_price(S, n, lag_sum, lag_max) : (pd_spec_draft_price){0, 0};
    uint32_t B = batch_bucket(e->model, plan->n_seqs);
    bstat *bs = S->stats ? bst_of(S, B) : NULL;
    double factor = S->calib_on ? pd_spec_calib_factor(&S->calib, B) : 1;
    pd_spec_choose_padded_f(&S->cost, n_base, n, n_yield, S->alpha, km, S->method == PD_SPEC_DRAFT ? &dp : NULL, step_cost, &pc,
                            kout, S->min_gain, factor);
    int any_k = 0;
    bool probe_ok = false;
    for (int j = 0; j < n; j++) {
        int i = S->sidx[j];
        kk[i] = kout[j];
        any_k |= kk[i] > 0;
    }
    const pd_spec_draft_price *dpp = S->method == PD_SPEC_DRAFT ? &dp : NULL;
    if (any_k && S->drain_on && S->draining) {  // a draining batch: its finish time must gain too
        int M = 0;
        for (int j = 0; j < n; j++) M = PD_MAX(M, kk[S->sidx[j]]);
        double ratio = 1;
        int m = drain_apply(e, plan, srs, n, S->alpha, kk, &pc, n_base, dpp, factor, &ratio);
        S->n_drain_eval++;
        S->n_drain_refused += m == 0;
        S->n_drain_capped += m > 0 && m < M;
        S->step_drain_refused = m == 0;
        if (bs) {
            bs->drain_refused += m == 0, bs->drain_capped += m > 0 && m < M;
            bs->drain_ratio_min = PD_MIN(bs->drain_ratio_min, ratio), bs->drain_ratio_max = PD_MAX(bs->drain_ratio_max, ratio);
        }
        any_k = m > 0;
    } else if (bs && !any_k) {
        bs->step_refused++;
    }
    if (bs) bs->judged++;
    bool policy_drafts = any_k, probing = false;  // by the policy's own choice; a probe step (not observed)
    for (int j = 0; j < n; j++) {
        int i = S->sidx[j];
        probe_ok |= kk[i] > 0 && srs[i]->probe_epoch == S->probe_epoch;
    }
    // The last probe succeeded iff one of its sequences now drafts by the policy's own choice (the
    // accepted probes raised the estimates enough); else probes back off (accepted drafts that
    // still do not pay at this batch are a failure too: the probe changed nothing).
    if (S->probe_wait) {
        pd_spec_backoff_result(&S->probe_bo, probe_ok);
        S->n_probe_ok += probe_ok;
        S->probe_wait = false;
    }
    if (due) {
        // A probe step: an estimate that says "never" would never be revised. Not where drafting
        // could not pay even at acceptance 1 (the most a probe can show): looked at again
        // PD_SPEC_PERIOD_MIN steps later. Else every idle candidate drafts 1 token (spec.h
        // "probes"), at most PROBE_SHARE of the time spent on probes: the period is the probe's
        // price (the padded verify step beyond a plain one, the draft's forward 1 with the probing
        // sequences' catch-up, eager after idle steps: its measured size) over that share of a
        // plain step, times the backoff (doubling while probes change nothing). In a step that
        // drafts anyway the probes cost less than that (priced the same: the period errs long).
        pd_spec_draft_price dp1 = dp;
        if (!any_k &&
            !pd_spec_probe_worth(&S->cost, n_base, n, n_yield, km, S->method == PD_SPEC_DRAFT ? &dp1 : NULL, step_cost, &pc, kout)) {
            S->next_probe = S->n_steps + PD_SPEC_PERIOD_MIN;
            S->n_probe_skip++;
        } else if (!any_k && S->drain_on && S->draining && !drain_probe_worth(e, plan, srs, n, km, &pc, n_base, dpp)) {
            S->next_probe = S->n_steps + PD_SPEC_PERIOD_MIN;  // the batch's remaining budgets leave nothing to win
            S->n_drain_probe_skip++;
        } else {
            int pl_sum = 0, pl_max = 0, m = pick_probes(S, plan, srs, n, &pl_sum, &pl_max);
            double c0 = step_cost(&pc, 0, n_base), c1 = m > 0 ? step_cost(&pc, 1, n_base + m) : COST_NEVER;
            if (c1 >= COST_NEVER && !any_k) {  // (a verify step would leave graphs: no probe at this batch)
                for (int j = 0; j < n; j++) kk[S->sidx[j]] = 0;
                S->next_probe = S->n_steps + PD_SPEC_PERIOD_MIN;
                S->n_probe_skip++;
            } else {
                if (c1 >= COST_NEVER) c1 = c0;
                pd_spec_draft_price p1 = S->method == PD_SPEC_DRAFT ? draft_price(S, m, pl_sum, pl_max) : (pd_spec_draft_price){0, 0};
                double base = pd_spec_probe_base(c1 - c0 + p1.first_us, c0, S->probe_share);
                S->next_probe = S->n_steps + pd_spec_backoff_period(&S->probe_bo, base);
                S->probe_epoch++;
                for (int j = 0; j < n; j++)
                    if (kk[S->sidx[j]] > 0) srs[S->sidx[j]]->probe_epoch = S->probe_epoch;
                S->probe_wait = true;  // judged by the next step's choice
                S->n_probes++;
                probing = true;
            }
        }
    } else if (any_k) {
        // The step verifies anyway: one more sequence in turn drafts 1 token, free.
        int i = S->sidx[(int)(S->probe_rot++ % n)];
        if (kk[i] == 0) kk[i] = 1;
    }
    // What the step expects and what it is priced at, for the realized-gain check (after_update):
    // steps that draft by the policy's choice only (a probe's verdict is not the model's promise).
    if (policy_drafts && !probing) {
        double expt = n_yield > n ? n_yield : n;
        int mk = 0, n_tok = n_base;
        for (int j = 0; j < n; j++) {
            int i = S->sidx[j], ki = kk[i];
            double p = 1;
            for (int r = 0; r < ki; r++) p *= S->alpha[j] > 0 ? S->alpha[j] : 0, expt += p;
            mk = PD_MAX(mk, ki), n_tok += ki;
        }
        double c = mk > 0 ? step_cost(&pc, mk, n_tok) : COST_NEVER;
        if (c < COST_NEVER) {
            S->cal_B = B;
            S->cal_exp = expt;
            S->cal_pred_us = c + (S->method == PD_SPEC_DRAFT ? dp.first_us + (mk - 1) * dp.next_us : 0);
        }
    }
    if (bs) bs->drafted += any_k;
    if (kout != tmp) pd_free(kout);
}

// The greedy rule over the device's argmaxes: row j is the target's token after the accepted
// drafts 0 .. j-1; accept draft j iff it equals that token (pd_sampler_verify, greedy).
static void verify_dev(espec *S, ereq *r, sreq *sr, const pd_sample_out *o, pd_step_output *out, pd_sample_result *res_out,
                       pd_sample_result *res) {
    (void)S;
    int32_t tok = -1;
    if (!sr || sr->k + sr->w == 0) {
        tok = pd_sampler_import_result(r->sampler, &o[0], res_out);
        pd_sampler_accept(r->sampler, tok);
        res[0] = *res_out;
        *out = (pd_step_output){.token = tok};
        return;
    }
    int na = 0;
    for (int j = 0; j <= sr->k; j++) {
        tok = pd_sampler_import_result(r->sampler, &o[j], &res[j]);
        pd_sampler_accept(r->sampler, tok);
        if (j == sr->k || tok != sr->draft[j]) break;
        sr->accepted[na++] = tok;
    }
    *out = (pd_step_output){.token = tok, .n_accepted = na, .accepted = sr->accepted};
    *res_out = res[na];
    if (sr->w) {
        int32_t pred[PD_SPEC_MAX_W];
        for (int j = 0; j < sr->w; j++) pred[j] = o[sr->k + j].token;
        pd_spec_jacobi_step(&sr->jac, pred, sr->pool);
    }
}

static pd_status verify(pd_engine *e, const pd_step_plan *plan, sreq **srs) {
    espec *S = e->spec;
    step_bufs *sb = &e->sb;
    bbuild *b = &S->bb;
    int V = S->V;
    bb_reset(b);
    int32_t span[1 + PD_SPEC_MAX_K + PD_SPEC_MAX_W];
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        sreq *sr = srs[i];
        sb->outputs[i] = (pd_step_output){.token = -1};
        if (sr && sr->k + sr->w > 0) {
            const int32_t *win = pd_spec_jacobi_window(&sr->jac);
            span[0] = s->tokens[0];
            memcpy(span + 1, sr->draft, sizeof(int32_t) * (size_t)sr->k);
            if (sr->w) memcpy(span + 1 + sr->k, win, sizeof(int32_t) * (size_t)sr->w);
            // Logits: the last token and every draft row (k + 1), then the window rows but the last.
            int n = 1 + sr->k + sr->w, nl = 1 + sr->k + (sr->w ? sr->w - 1 : 0);
            if (!bb_add(b, span, n, s->pos_start, s->block_ids, S->bs, 0)) return PD_ERR_NOMEM;
            S->row0[i] = b->nl;
            if (PD_ARRAY_RESERVE(b->lr, b->cap_lr, (size_t)(b->nl + nl))) return PD_ERR_NOMEM;
            for (int r = 0; r < nl; r++) b->lr[b->nl++] = b->nt - n + r;
        } else {
            if (!bb_add(b, s->tokens, s->n_tokens, s->pos_start, s->block_ids, S->bs, s->needs_logits ? 1 : 0))
                return PD_ERR_NOMEM;
            S->row0[i] = s->needs_logits ? b->nl - 1 : -1;
        }
    }
    pd_batch batch = bb_batch(b);
    // Every row greedy without penalties, biases or masks: the device takes the argmaxes (and
    // logprobs), as the plain path's device sampling does; else the rows come to the host.
    bool dev = S->dev_sample && b->nl > 0;
    for (int i = 0; dev && i < plan->n_seqs; i++)
        if (S->row0[i] >= 0) dev = dev_greedy(pd_engine_req_find(e, plan->seqs[i].req_id)->sampler);
    int64_t t0 = pd_time_us();
    pd_status st;
    if (dev) {
        const float *dl = NULL;
        st = pd_model_forward_dev(e->model, e->cache, &batch, &dl);
        if (st) return st;
        if (!reserve_drows(S, b->nl)) return PD_ERR_NOMEM;
        for (int i = 0; i < plan->n_seqs; i++) {
            if (S->row0[i] < 0) continue;
            ereq *r = pd_engine_req_find(e, plan->seqs[i].req_id);
            int nr = srs[i] && srs[i]->k + srs[i]->w > 0 ? 1 + srs[i]->k + (srs[i]->w ? srs[i]->w - 1 : 0) : 1;
            for (int j = 0; j < nr; j++) pd_sampler_export_row(r->sampler, 0, &S->drows[S->row0[i] + j], NULL);
        }
        pd_sample_params sp = {.logits = (float *)dl, .n_rows = b->nl, .vocab = V, .rows = S->drows, .out = S->douts};
        pd_op_sample(e->backend, &sp);
    } else {
        if (!reserve_logits(S, PD_MAX(b->nl, 1))) return PD_ERR_NOMEM;
        st = pd_model_forward(e->model, e->cache, &batch, S->logits);
        if (st) return st;
    }
    int64_t dt = pd_time_us() - t0;
    int vmax_q = 1;
    for (int i = 0; i < b->ns; i++) vmax_q = PD_MAX(vmax_q, b->qi[i + 1] - b->qi[i]);
    S->last_vtok = pd_model_step_tokens(e->model, b->ns, vmax_q, b->nt);  // observed with the whole step's time
    S->last_vkey = shape_key(e->model, b->ns, vmax_q, b->nt);
    S->last_vgraph = step_is_graph(e->model, b->ns, vmax_q);
    S->verify_us += dt;
    S->verify_n++;
    int K1 = S->K + 1;
    int n_threads = plan->n_seqs >= 4 && V >= 16384 ? PD_MIN(plan->n_seqs, S->n_scratch) : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        if (S->row0[i] < 0) continue;
        ereq *r = pd_engine_req_find(e, s->req_id);
        sreq *sr = srs[i];
        if (dev) {
            verify_dev(S, r, sr, S->douts + S->row0[i], &sb->outputs[i], &sb->results[i],
                       S->results + (size_t)i * (size_t)K1);
            continue;
        }
        float *row = S->logits + (size_t)S->row0[i] * (size_t)V;
        if (!sr || sr->k + sr->w == 0) {
            sb->outputs[i].token = pd_sampler_sample(r->sampler, row, &sb->results[i]);
            pd_sampler_accept(r->sampler, sb->outputs[i].token);
            S->results[(size_t)i * (size_t)K1] = sb->results[i];
            continue;
        }
        float *scratch = S->scratch + (size_t)omp_get_thread_num() * (size_t)V;
        pd_sample_result *res = S->results + (size_t)i * (size_t)K1;
        int na = 0;
        int32_t tok = -1;
        // Jacobi guesses come from the raw rows, before sampling transforms them.
        int32_t pred[PD_SPEC_MAX_W];
        if (sr->w)
            for (int j = 0; j < sr->w; j++) pred[j] = pd_argmax(row + (size_t)(sr->k + j) * (size_t)V, V);
        for (int j = 0; j <= sr->k; j++) {
            float *lj = row + (size_t)j * (size_t)V;
            if (j == sr->k) {
                tok = pd_sampler_sample(r->sampler, lj, &res[j]);
                pd_sampler_accept(r->sampler, tok);
                break;
            }
            bool ok = false;
            const float *q = sr->q ? sr->q + (size_t)j * (size_t)V : NULL;
            tok = pd_sampler_verify(r->sampler, lj, sr->draft[j], q, scratch, &ok, &res[j]);
            pd_sampler_accept(r->sampler, tok);
            if (!ok) break;
            sr->accepted[na++] = tok;
        }
        sb->outputs[i] = (pd_step_output){.token = tok, .n_accepted = na, .accepted = sr->accepted};
        sb->results[i] = res[na];
        if (sr->w) pd_spec_jacobi_step(&sr->jac, pred, sr->pool);
    }
    return PD_OK;
}

static pd_status run_plan(pd_engine *e, const pd_step_plan *plan, bool *handled);

void pd_engine_spec_pause(pd_engine *e, bool paused) {
    if (e && e->spec) __atomic_store_n(&e->spec->paused, paused, __ATOMIC_RELEASE);
}

pd_status pd_engine_spec_run_plan(pd_engine *e, const pd_step_plan *plan, bool *handled) {
    espec *S = e->spec;
    *handled = false;
    if (!S) return PD_OK;
    if (__atomic_load_n(&S->paused, __ATOMIC_ACQUIRE)) {  // as without speculation (bench-spec "paused")
        S->last_valid = false;
        S->srs_n = 0;
        S->step_paused = true;
        return PD_OK;
    }
    S->step_paused = false;
    int64_t t0 = pd_time_us(), v0 = S->verify_us, d0 = S->draft_us;
    pd_status st = run_plan(e, plan, handled);
    int64_t us = pd_time_us() - t0 - (S->verify_us - v0) - (S->draft_us - d0);
    if (*handled) S->hook_us += us;
    else S->hook_plain_us += us;
    return st;
}

// Whether an adaptive step with no request busy and no probe due has nothing to decide (the idle
// fast path): draft-free methods' idle sequences look for proposals only on probe steps (and a
// lookahead window rides only while it pays, or as a probe); the draft method's last full step
// chose no draft for this very batch of single-token decodes (S->quiet_n), and the choice changes
// only with new evidence (a probe's), a new batch or an arrival (a busy request).
static bool idle_step(const espec *S, const pd_step_plan *plan) {
    if (S->method == PD_SPEC_NGRAM) return true;
    if (S->method == PD_SPEC_LOOKAHEAD) return S->win_quiet_n == plan->n_seqs && S->n_steps < S->next_win_probe;
    if (S->quiet_n != plan->n_seqs || (S->drain_on && S->quiet_drain != S->draining)) return false;
    if (S->n_steps >= S->quiet_until) return false;  // a drain refusal's hold ran out: judged again
    for (int i = 0; i < plan->n_seqs; i++)  // a prefill chunk (a recompute after preemption): the draft mirrors it
        if (plan->seqs[i].n_tokens != 1) return false;
    return true;
}

static pd_status run_plan(pd_engine *e, const pd_step_plan *plan, bool *handled) {
    espec *S = e->spec;
    S->last_valid = false;
    S->last_vtok = 0;
    S->last_vkey = 0;
    S->last_vgraph = false;
    S->step_draft_us = 0;
    S->la_win_tokens = 0;
    S->srs_n = 0;
    S->probe_pick = -1;
    S->probe_look = false;
    S->draining = false;
    S->step_drain_refused = false;
    S->cal_B = 0;
    S->cal_emitted = 0;
    if (S->drain_on) {
        pd_sched_stats ss;
        pd_sched_stats_get(e->sched, &ss);
        S->draining = ss.n_waiting == 0 && ss.n_loading == 0;
    }
    if (S->adaptive && S->n_busy == 0 && S->n_steps > 0 && S->n_steps < S->next_probe && idle_step(S, plan)) {
        S->n_fast++;  // the idle fast path: a plain step, as without speculation
        if (S->stats) {
            bstat *b = bst_of(S, batch_bucket(e->model, plan->n_seqs));
            if (b) b->fast++;
        }
        S->n_steps++;
        return PD_OK;
    }
    if (S->stats && S->method == PD_SPEC_DRAFT && S->quiet_n == plan->n_seqs && S->n_steps >= S->quiet_until) {
        bstat *b = bst_of(S, batch_bucket(e->model, plan->n_seqs));
        if (b) b->rejudged++;
    }
    S->quiet_n = -1;
    if (!reserve_seqs(S, plan->n_seqs)) return PD_ERR_NOMEM;
    sreq **srs = S->srs;
    bool any = false, draft_work = false, all_dec = true;
    int n_idle = 0;
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        ereq *r = pd_engine_req_find(e, s->req_id);
        sreq *sr = r ? r->spec : NULL;
        all_dec &= s->n_tokens == 1;
        // A history that missed tokens (out of memory in sreq_push) cannot feed the draft or the
        // proposals: that request runs plainly from now on.
        if (sr && sr->n < s->pos_start + s->n_tokens) sr = NULL;
        srs[i] = sr;
        S->kmax[i] = 0;
        S->kch[i] = 0;
        if (!sr) continue;
        sr->k = sr->w = 0;
        sr->q = NULL;
        sr->looked = false;
        // Where the draft's KV stands: a first appearance mid-prompt (a prefix hit) has the hit's
        // draft KV in the same blocks; one that starts decoding (a remote prefill) has none.
        if (sr->draft_pos < 0) sr->draft_pos = is_decode(s, sr) ? 0 : s->pos_start;
        if (s->pos_start < sr->draft_pos) sr->draft_pos = s->pos_start;  // preempted and recomputed
        if (S->draft && !is_decode(s, sr) && sr->draft_pos < s->pos_start + s->n_tokens) draft_work = true;
        if (s->n_lookahead <= 0 || !is_decode(s, sr)) continue;
        int room = PD_MIN(s->n_lookahead, S->K);
        if (S->method == PD_SPEC_DRAFT && s->pos_start + 1 - sr->draft_pos > CATCHUP_MAX) {
            draft_work = true;  // too far behind: catch up first (chunked), draft later
            room = 0;
        }
        // Adaptive: a sequence that chose no draft last step looks for a proposal (a prompt-lookup
        // scan, a pool probe: up to tens of microseconds at a long context, where a step of a small
        // model is ~100-300 us) only when it is the one probe of a probe step, picked below.
        if (S->adaptive && !sr->fixed_k && S->method != PD_SPEC_DRAFT && sr->last_k == 0 && S->n_steps > 0 && room > 0) {
            S->kmax[i] = -room;  // idle: a probe candidate
            n_idle++;
            continue;
        }
        if (sr->last_k == LAST_K_NOMATCH && S->n_steps < sr->retry_at) continue;  // its next lookup is later
        // Session 15: an uninformed draft-model request explores at k = 1 first (spec.h PD_SPEC_EXPLORE_N).
        if (S->adaptive && !sr->fixed_k && S->method == PD_SPEC_DRAFT) room = pd_spec_explore_cap(sr->informed, sr->n_steps, room, S->explore_n, plan->n_seqs);
        S->kmax[i] = room;
        sr->looked = S->method != PD_SPEC_DRAFT && room > 0;
    }
    if (n_idle) {  // on a probe step every idle sequence looks (single-sequence probes: one in turn), else none
        bool due = S->n_steps >= S->next_probe;
        int pick = due && !S->probe_group ? (int)(S->probe_rot++ % n_idle) : -1;
        S->probe_look = due;
        for (int i = 0, c = 0; i < plan->n_seqs; i++)
            if (S->kmax[i] < 0) {
                bool look = due && (S->probe_group || c == pick);
                c++;
                if (look) S->kmax[i] = -S->kmax[i];
                else S->kmax[i] = 0;
                if (look && !S->probe_group) S->probe_pick = i;
            }
    }
    if (S->method == PD_SPEC_NGRAM || S->method == PD_SPEC_LOOKAHEAD) propose_free(e, plan, srs);
    choose_lengths(e, plan, srs);
    for (int i = 0; i < plan->n_seqs; i++) {
        any |= S->kch[i] > 0;
        if (srs[i] && S->method != PD_SPEC_DRAFT) srs[i]->k = S->kch[i];
        sreq *sr = srs[i];
        if (!sr || !is_decode(&plan->seqs[i], sr)) continue;
        if (sr->looked && S->kmax[i] == 0 && S->adaptive && !sr->fixed_k) {  // looked, found nothing
            int wait = pd_spec_nomatch_wait(++sr->n_miss);
            if (wait > 0) {
                sr->retry_at = S->n_steps + wait;
                set_last_k(sr, LAST_K_NOMATCH);
            } else {
                set_last_k(sr, 0);  // idle: probes only (the lookup state starts over after a probe)
                sr->n_miss = 0;
            }
            continue;
        }
        if (sr->looked) sr->n_miss = 0;
        if (S->kch[i] == 0) sr->ng_hint = -1;  // (the alignment is set again after a drafting step)
        if (sr->last_k == LAST_K_NOMATCH && !sr->looked) continue;  // waiting for its retry
        set_last_k(sr, S->kch[i]);
    }
    if (S->method == PD_SPEC_LOOKAHEAD) {
        // The Jacobi window rides along while it pays: W extra tokens per sequence add dt to a
        // step of cost C; they are worth the accepted tokens they bring (la_yield per window token,
        // measured) against the n tokens the step yields anyway: ride iff yield * n_win * W / n >
        // dt / C (always with fixed lengths; and now and then, so that the yield is measured).
        int n_base = plan->n_tokens, n_win = 0;
        for (int i = 0; i < plan->n_seqs; i++) n_base -= plan->seqs[i].n_lookahead;
        for (int i = 0; i < plan->n_seqs; i++) n_win += srs[i] && is_decode(&plan->seqs[i], srs[i]) && plan->seqs[i].n_lookahead > 0;
        pad_ctx pc = pad_of(e, plan);
        int kmx = 0;
        for (int i = 0; i < plan->n_seqs; i++) kmx = PD_MAX(kmx, srs[i] ? srs[i]->k : 0);
        double cw = step_cost(&pc, kmx + S->W, n_base + n_win * S->W), c0 = step_cost(&pc, kmx, n_base);
        double rel = (cw - c0) / (c0 > 1 ? c0 : 1);
        bool cheap = !S->adaptive || (n_win > 0 && S->la_yield * n_win * S->W / PD_MAX(plan->n_seqs, 1) > rel);
        // Else a probe now and then (the yield must stay measured): one sequence's window, at
        // most PROBE_SHARE of the time (its cost is that of one window: rel / n_win).
        int only = -1;
        bool quiet = S->adaptive && !cheap;
        // While windows do not pay, each window probe doubles the period to the next one
        // (pd_spec_backoff); a step where they pay resets it.
        if (cheap && S->adaptive) pd_spec_backoff_result(&S->win_bo, true);
        if (!cheap && n_win > 0 && S->n_steps >= S->next_win_probe && cw < COST_NEVER) {
            int pick = (int)(S->probe_rot++ % n_win), c = 0;
            for (int i = 0; i < plan->n_seqs && only < 0; i++)
                if (srs[i] && is_decode(&plan->seqs[i], srs[i]) && plan->seqs[i].n_lookahead > 0 && c++ == pick) only = i;
            double c1 = step_cost(&pc, kmx + S->W, n_base + S->W);
            S->next_win_probe = S->n_steps + pd_spec_backoff_period(&S->win_bo, pd_spec_probe_base(c1 - c0, c0, S->probe_share));
            pd_spec_backoff_result(&S->win_bo, false);
            S->n_win_probes += only >= 0;
            cheap = only >= 0;
        }
        S->win_quiet_n = quiet && only < 0 ? plan->n_seqs : -1;
        for (int i = 0; cheap && i < plan->n_seqs; i++) {
            sreq *sr = srs[i];
            if (!sr || !is_decode(&plan->seqs[i], sr) || (only >= 0 && i != only)) continue;
            if (plan->seqs[i].n_lookahead - sr->k >= S->W) sr->w = S->W;
            any |= sr->w > 0;
            S->la_win_tokens += sr->w;
        }
        S->n_win_steps += S->la_win_tokens > 0;
    }
    pd_status st = PD_OK;
    if (S->draft && (any || draft_work)) {
        st = run_draft(e, plan, srs);
        if (st) goto out;
    }
    if (!any) goto out;  // the plain path runs the target (device sampling, graphs)
    st = verify(e, plan, srs);
    if (st) goto out;
    *handled = true;
    S->last_valid = true;
    if (S->method == PD_SPEC_LOOKAHEAD && S->la_win_tokens > 0) {
        int64_t acc = 0;
        for (int i = 0; i < plan->n_seqs; i++)
            if (srs[i] && srs[i]->k > 0) acc += e->sb.outputs[i].n_accepted;
        S->la_yield = 0.9 * S->la_yield + 0.1 * (double)acc / (double)S->la_win_tokens;
    }
    if (S->cal_B)  // the realized-gain check: every token the step emitted (after_update has its time)
        for (int i = 0; i < plan->n_seqs; i++)
            if (S->row0[i] >= 0) S->cal_emitted += 1 + (srs[i] && srs[i]->k > 0 ? e->sb.outputs[i].n_accepted : 0);
    for (int i = 0; i < plan->n_seqs; i++) {
        sreq *sr = srs[i];
        if (!sr || sr->k == 0) continue;
        const pd_step_output *o = &e->sb.outputs[i];
        pd_spec_accept_update(&sr->acc, sr->k, o->n_accepted);
        pd_spec_accept_update(&S->pop, sr->k, o->n_accepted);
        S->pop_n++;
        sr->n_drafted += sr->k;
        sr->n_accepted += o->n_accepted;
        sr->n_fail += o->n_accepted < sr->k;
        sr->n_steps++;
        S->drafted[S->method] += sr->k;
        S->accepted[S->method] += o->n_accepted;
        S->emitted[S->method] += o->n_accepted + 1;
        S->steps[S->method]++;
        for (int j = 0; j <= PD_MIN(o->n_accepted, sr->k - 1); j++) S->pos_reached[j]++;
        for (int j = 0; j < o->n_accepted; j++) S->pos_accepted[j]++;
        // ngram: the next proposal continues the source after this one's accepted drafts and the
        // target's own token (which took the place of the first rejected draft, or is the bonus).
        if (S->method == PD_SPEC_NGRAM) sr->ng_hint = sr->ng_src >= 0 ? sr->ng_src + o->n_accepted + 1 : -1;
        // The draft's KV past the accepted tokens holds rejected drafts: cut it back.
        sr->draft_pos = PD_MIN(sr->draft_pos, plan->seqs[i].pos_start + 1 + o->n_accepted);
    }
out:
    // The draft method: a full step of single-token decodes that drafted nothing and had no draft
    // work holds for the next steps of the same batch (idle_step), while nobody is busy.
    if (S->method == PD_SPEC_DRAFT && S->adaptive && S->idle_fast && !st && !any && !draft_work && all_dec) {
        S->quiet_n = plan->n_seqs, S->quiet_drain = S->draining;
        // A drain refusal holds drain_hold steps, then is judged again (0: until the state changes).
        S->quiet_until = S->step_drain_refused && S->drain_hold > 0 ? S->n_steps + 1 + S->drain_hold : INT64_MAX;
    }
    S->n_steps++;
    S->srs_n = st ? 0 : plan->n_seqs;  // after_update's view of this step
    return st;
}

void pd_engine_spec_push_token(ereq *q, int32_t token) {
    if (q->spec && token >= 0) (void)sreq_push(q->spec, token);  // OOM: proposals only see less
}

void pd_engine_spec_after_update(pd_engine *e, const pd_step_plan *plan, int64_t step_us, bool was_spec) {
    espec *S = e->spec;
    if (!S || S->step_paused) return;
    int64_t t0 = pd_time_us();
    // Whole steps (scheduling, forward, sampling, update) on both sides, the draft's forwards
    // apart (they are the draft's cost): plain steps at their real (padded) tokens, verify steps
    // at the verify forward's.
    int vt = S->last_vtok;
    uint32_t key = S->last_vkey;
    bool graph = S->last_vgraph;
    if (!was_spec || vt <= 0) {
        int mq = 1, nt = 0;  // real tokens: plan->n_tokens counts granted lookahead slots too
        for (int i = 0; i < plan->n_seqs; i++) mq = PD_MAX(mq, plan->seqs[i].n_tokens), nt += plan->seqs[i].n_tokens;
        vt = pd_model_step_tokens(e->model, plan->n_seqs, mq, nt);
        key = shape_key(e->model, plan->n_seqs, mq, nt);
        graph = step_is_graph(e->model, plan->n_seqs, mq);
    }
    double us = (double)(step_us - S->step_draft_us);
    // The realized-gain check: a step that drafted by the policy's choice, at a verify shape timed
    // live before (a shape's first run is no price: pd_spec_shapes; without graphs, key 0, every one).
    if (was_spec && S->cal_B && (!key || pd_spec_shapes_get(&S->shapes, key) > 0))
        pd_spec_calib_observe(&S->calib, S->cal_B, (double)S->cal_emitted, S->cal_exp, (double)step_us, S->cal_pred_us);
    pd_spec_cost_observe(graph ? &S->cost : &S->cost_eager, vt, us);
    pd_spec_shapes_observe(&S->shapes, key, us);
    // (Not a shape's first live step: a graph's first launch, the step buffers' first growth — up to
    // ms more; session 14 call 2: one such step priced the untimed batch-64 verify shape at 1.43x a
    // plain step, the policy refused it from then on, and the shape was never timed live.)
    if (pd_spec_shapes_get_n(&S->shapes, key) >= 2) host_observe(S, key, us);
    // Next step's lookahead asks: what was chosen now, plus one to let it grow (and 1 when it was
    // 0, for the probes); every slot when the choice took every slot granted (it was the slots that
    // limited it: growing one a step, a sequence back from a short step took k steps to reach k
    // again); unchanged when a lookup found nothing (the next one may find k). The Jacobi window
    // always (only budget: unused slots cost no compute). Asked only when it changes: a step that
    // drafts nothing does O(1) here per sequence.
    int extra = S->method == PD_SPEC_LOOKAHEAD ? S->W : 0;
    for (int i = 0; i < plan->n_seqs && i < S->srs_n && S->adaptive; i++) {
        sreq *sr = S->srs[i];
        if (!sr || sr->fixed_k || !is_decode(&plan->seqs[i], sr) || plan->seqs[i].n_lookahead <= 0) continue;
        if (sr->looked && S->kmax[i] == 0) continue;  // no proposal: keep the ask
        int granted = PD_MIN(plan->seqs[i].n_lookahead - extra, S->K);
        int want = (S->kch[i] > 0 && S->kch[i] >= granted ? S->K : PD_MIN(S->K, S->kch[i] + 1)) + extra;
        if (want == sr->la_want) continue;
        if (pd_sched_set_lookahead(e->sched, plan->seqs[i].req_id, want) == PD_OK) sr->la_want = want;
    }
    if (!was_spec) S->plain_n++, S->plain_us += step_us, S->hook_plain_us += pd_time_us() - t0;
    else S->hook_us += pd_time_us() - t0;
}

const char *pd_engine_spec_method_name(int m) { return pd_spec_method_name((pd_spec_method)m); }

const pd_sample_result *pd_engine_spec_result(pd_engine *e, int seq_index, int out_index) {
    espec *S = e->spec;
    if (!S || !S->last_valid || seq_index < 0 || seq_index >= S->cap_res_seqs || out_index < 0 || out_index > S->K) return NULL;
    return &S->results[(size_t)seq_index * (size_t)(S->K + 1) + (size_t)out_index];
}

void pd_engine_spec_fill_finished(pd_engine *e, const ereq *q, pd_engine_event *o) {
    espec *S = e->spec;
    if (!S || !q || !q->spec) return;
    o->spec_method = S->method;
    o->n_spec_drafted = (int)q->spec->n_drafted;
    o->n_spec_accepted = (int)q->spec->n_accepted;
    o->n_spec_steps = (int)q->spec->n_steps;
}

void pd_engine_spec_stats(pd_engine *e, pd_engine_stats *o) {
    espec *S = e->spec;
    if (!S) return;
    o->spec_method = S->method;
    memcpy(o->spec_drafted, S->drafted, sizeof o->spec_drafted);
    memcpy(o->spec_accepted, S->accepted, sizeof o->spec_accepted);
    memcpy(o->spec_emitted, S->emitted, sizeof o->spec_emitted);
    memcpy(o->spec_steps, S->steps, sizeof o->spec_steps);
    _Static_assert(sizeof o->spec_pos_reached == sizeof S->pos_reached, "per-position counters");
    memcpy(o->spec_pos_reached, S->pos_reached, sizeof o->spec_pos_reached);
    memcpy(o->spec_pos_accepted, S->pos_accepted, sizeof o->spec_pos_accepted);
}
