// sample.c — see sample.h. Token counts are a dense array of vocab ints: a few hundred KB for a
// 128k vocabulary, touched sparsely, and it keeps penalties O(generated tokens) per step.
#include "model/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

struct pd_sampler {
    pd_sampling_params p;
    int vocab;
    uint64_t seed;
    uint64_t n_draws;      // draws made: the next draw uses pd_sample_uniform(seed, n_draws)
    uint64_t n_out;        // tokens accepted (pd_sampler_accept): speculative draws' position
    int32_t *out_counts;   // (vocab) generated-token counts
    uint8_t *seen;         // (vocab) in prompt or output (repetition penalty)
    int32_t *touched;      // ids with out_counts > 0, for O(k) penalty application
    int n_touched;
    size_t cap_touched;
    int32_t *seen_ids;
    int n_seen;
    size_t cap_seen;
    int32_t *idx;          // (vocab) scratch for sorting
    float *raw;            // (vocab) unprocessed logits for logprobs; allocated on first use
    float *ex;             // (vocab) exp(logit - max) scratch
    pd_sample_ctl *ctl;    // owned or NULL: logit bias, token mask source
    uint32_t *mask;        // (mask words) the last mask; allocated on first use
};

pd_sampling_params pd_sampling_params_default(void) {
    pd_sampling_params p = {0};
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    p.n_logprobs = -1;
    return p;
}

pd_status pd_sampling_params_validate(const pd_sampling_params *p, pd_err *err) {
    if (!(p->temperature >= 0) || p->temperature > 100) return pd_err_set(err, PD_ERR_INVALID, "temperature must be between 0 and 100");
    if (!(p->top_p > 0 && p->top_p <= 1)) return pd_err_set(err, PD_ERR_INVALID, "top_p must be in (0, 1]");
    if (!(p->min_p >= 0 && p->min_p <= 1)) return pd_err_set(err, PD_ERR_INVALID, "min_p must be in [0, 1]");
    if (p->top_k < -1) return pd_err_set(err, PD_ERR_INVALID, "top_k must be -1, 0 or positive");
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return pd_err_set(err, PD_ERR_INVALID, "presence_penalty must be between -2 and 2");
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return pd_err_set(err, PD_ERR_INVALID, "frequency_penalty must be between -2 and 2");
    if (!(p->repetition_penalty > 0 && p->repetition_penalty <= 10))
        return pd_err_set(err, PD_ERR_INVALID, "repetition_penalty must be in (0, 10]");
    if (p->n_logprobs < -1 || p->n_logprobs > PD_MAX_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "logprobs must be between 0 and %d", PD_MAX_LOGPROBS);
    return PD_OK;
}

static uint64_t g_seed_counter;

pd_sampler *pd_sampler_new(const pd_sampling_params *p, int vocab) {
    pd_sampler *s = pd_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *p;
    s->vocab = vocab;
    s->out_counts = pd_calloc((size_t)vocab, sizeof(int32_t));
    s->seen = pd_calloc((size_t)vocab, 1);
    s->idx = pd_malloc(sizeof(int32_t) * (size_t)vocab);
    s->ex = pd_malloc(sizeof(float) * (size_t)vocab);
    if (!s->out_counts || !s->seen || !s->idx || !s->ex) {
        pd_sampler_free(s);
        return NULL;
    }
    uint64_t seed = p->has_seed ? p->seed
                                : (uint64_t)pd_time_us() ^ (__atomic_add_fetch(&g_seed_counter, 1, __ATOMIC_RELAXED) * 0x9e3779b97f4a7c15ull);
    s->seed = seed;
    return s;
}

void pd_sampler_free(pd_sampler *s) {
    if (!s) return;
    pd_free(s->out_counts);
    pd_free(s->seen);
    pd_free(s->touched);
    pd_free(s->seen_ids);
    pd_free(s->idx);
    pd_free(s->raw);
    pd_free(s->ex);
    pd_sample_ctl_free(s->ctl);
    pd_free(s->mask);
    pd_free(s);
}

void pd_sample_ctl_free(pd_sample_ctl *c) {
    if (!c) return;
    if (c->mask_ops && c->mask_ops->free) c->mask_ops->free(c->mask_ud);
    pd_free(c->bias);
    pd_free(c);
}

pd_status pd_sampler_set_ctl(pd_sampler *s, pd_sample_ctl *ctl) {
    if (s->ctl != ctl) pd_sample_ctl_free(s->ctl);
    s->ctl = ctl;
    if (ctl && ctl->mask_ops && !s->mask && !(s->mask = pd_malloc(sizeof(uint32_t) * (size_t)pd_sampler_mask_words(s)))) {
        pd_sample_ctl_free(ctl);
        s->ctl = NULL;
        return PD_ERR_NOMEM;
    }
    return PD_OK;
}

bool pd_sampler_has_mask(const pd_sampler *s) { return s->ctl && s->ctl->mask_ops; }
int pd_sampler_mask_words(const pd_sampler *s) { return (s->vocab + 31) / 32; }

void pd_sampler_fill_mask(pd_sampler *s, uint32_t *mask) {
    int w = pd_sampler_mask_words(s);
    if (!pd_sampler_has_mask(s)) {
        memset(mask, 0xff, sizeof(uint32_t) * (size_t)w);
        return;
    }
    s->ctl->mask_ops->fill(s->ctl->mask_ud, mask);
}

// Sets the tokens the mask disallows to -inf (s->mask was allocated by pd_sampler_set_ctl).
static void apply_mask(pd_sampler *s, float *logits) {
    pd_sampler_fill_mask(s, s->mask);
    for (int i = 0; i < s->vocab; i++)
        if (!((s->mask[i >> 5] >> (i & 31)) & 1)) logits[i] = -INFINITY;
}

static void apply_bias(const pd_sampler *s, float *logits) {
    for (int i = 0; i < s->ctl->n_bias; i++) {
        const pd_logit_bias *b = &s->ctl->bias[i];
        if (b->token < 0 || b->token >= s->vocab) continue;
        logits[b->token] = b->bias <= PD_SAMPLE_BIAS_BAN ? -INFINITY : logits[b->token] + b->bias;
    }
}

static void push(int32_t **arr, int *n, size_t *cap, int32_t v) {
    if (PD_ARRAY_RESERVE(*arr, *cap, (size_t)*n + 1)) return;  // penalties degrade gracefully under OOM (benign)
    (*arr)[(*n)++] = v;
}

static void mark_seen(pd_sampler *s, int32_t t) {
    if (t < 0 || t >= s->vocab || s->seen[t]) return;
    s->seen[t] = 1;
    push(&s->seen_ids, &s->n_seen, &s->cap_seen, t);
}

void pd_sampler_add_prompt(pd_sampler *s, const int32_t *ids, int n) {
    if (s->p.repetition_penalty == 1.0f) return;
    for (int i = 0; i < n; i++) mark_seen(s, ids[i]);
}

void pd_sampler_accept(pd_sampler *s, int32_t t) {
    if (t < 0 || t >= s->vocab) return;
    s->n_out++;
    if (pd_sampler_has_mask(s) && s->ctl->mask_ops->accept(s->ctl->mask_ud, t))
        PD_LOG_W("sampler: the mask source refused token %d", t);  // a token the mask allowed: cannot happen
    if (s->out_counts[t]++ == 0) push(&s->touched, &s->n_touched, &s->cap_touched, t);
    if (s->p.repetition_penalty != 1.0f) mark_seen(s, t);
}

int32_t pd_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static __thread const float *t_sort_vals;
static int cmp_desc(const void *a, const void *b) {
    float x = t_sort_vals[*(const int32_t *)a], y = t_sort_vals[*(const int32_t *)b];
    if (x > y) return -1;
    if (x < y) return 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

// Raw log-softmax values for the chosen token and the top-N.
static void fill_logprobs(pd_sampler *s, const float *raw, int32_t token, pd_sample_result *out) {
    int V = s->vocab;
    float mx = raw[pd_argmax(raw, V)];
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)(raw[i] - mx));
    float lse = mx + (float)log(sum);
    out->logprob = raw[token] - lse;
    out->n_top = 0;
    int n = PD_MIN(s->p.n_logprobs, V);
    // Partial selection: n is small (<= 20), so n passes over the vocab are fine.
    for (int k = 0; k < n; k++) {
        int32_t best = -1;
        for (int i = 0; i < V; i++) {
            bool taken = false;
            for (int j = 0; j < k && !taken; j++) taken = out->top_ids[j] == i;
            if (!taken && (best < 0 || raw[i] > raw[best])) best = i;
        }
        out->top_ids[k] = best;
        out->top_logprobs[k] = raw[best] - lse;
        out->n_top++;
    }
}

static void apply_penalties(pd_sampler *s, float *logits) {
    const pd_sampling_params *p = &s->p;
    if (p->repetition_penalty != 1.0f) {
        for (int i = 0; i < s->n_seen; i++) {
            float *l = &logits[s->seen_ids[i]];
            *l = *l > 0 ? *l / p->repetition_penalty : *l * p->repetition_penalty;
        }
    }
    if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
        for (int i = 0; i < s->n_touched; i++) {
            int32_t t = s->touched[i];
            logits[t] -= p->presence_penalty + p->frequency_penalty * (float)s->out_counts[t];
        }
    }
}

// Draws from candidates idx[0..n), which are in increasing id order, with weights e[idx[i]]: the
// first candidate whose running sum exceeds u * total (the device op walks the same order).
static int32_t draw(pd_sampler *s, const float *e, const int32_t *idx, int n) {
    double sum = 0;
    for (int i = 0; i < n; i++) sum += e[idx[i]];
    double r = pd_sample_uniform(s->seed, s->n_draws++) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += e[idx[i]];
        if (r < acc) return idx[i];
    }
    return idx[n - 1];
}

// The k largest logits, sorted descending (ties: lower id first), via a size-k min-heap: O(V log k).
static int top_k_sorted(pd_sampler *s, const float *l, int V, int k) {
    int32_t *h = s->idx;
    int n = 0;
#define LESS(a, b) (l[a] < l[b] || (l[a] == l[b] && (a) > (b)))  // "a ranks below b"
    for (int32_t i = 0; i < V; i++) {
        if (n < k) {
            int c = n++;
            h[c] = i;
            while (c > 0 && LESS(h[c], h[(c - 1) / 2])) {
                int32_t t = h[c]; h[c] = h[(c - 1) / 2]; h[(c - 1) / 2] = t;
                c = (c - 1) / 2;
            }
        } else if (LESS(h[0], i)) {
            h[0] = i;
            for (int c = 0;;) {
                int a = 2 * c + 1, b = a + 1, m = c;
                if (a < n && LESS(h[a], h[m])) m = a;
                if (b < n && LESS(h[b], h[m])) m = b;
                if (m == c) break;
                int32_t t = h[c]; h[c] = h[m]; h[m] = t;
                c = m;
            }
        }
    }
#undef LESS
    t_sort_vals = l;
    qsort(h, (size_t)n, sizeof(int32_t), cmp_desc);
    return n;
}

// NOTE: the hot path of every sampled token. One expf pass over the vocabulary; no full sort (a
// qsort of a 128k vocabulary per token made serving CPU-bound at ~25 ms a token): top-k uses a
// heap, top-p first bisects the logit threshold whose tail holds the top_p mass, then sorts only
// the tokens above it, so the cut is exact.
// The survivors of penalties → temperature → top-k → top-p → min-p: s->idx[0..n) in increasing id
// order (all of the vocabulary when no filter is on) with weights s->ex[id]. logits are scaled.
static int select_candidates(pd_sampler *s, float *logits) {
    const pd_sampling_params *p = &s->p;
    int V = s->vocab;
    float inv_t = 1.0f / p->temperature, mx = -INFINITY;
    for (int i = 0; i < V; i++) {
        logits[i] *= inv_t;
        if (logits[i] > mx) mx = logits[i];
    }
    float *e = s->ex;
    double total = 0;
    for (int i = 0; i < V; i++) total += (e[i] = expf(logits[i] - mx));
    bool has_k = p->top_k > 0 && p->top_k < V, has_p = p->top_p < 1.0f;
    int n;
    if (has_k) {
        n = top_k_sorted(s, logits, V, p->top_k);
    } else if (has_p) {
        // Largest threshold tau with mass(logit >= tau) >= top_p * total (bisection on tau).
        double want = (double)p->top_p * total;
        float lo = mx - 60.0f, hi = mx;
        for (int it = 0; it < 28; it++) {
            float mid = 0.5f * (lo + hi);
            double m = 0;
            for (int i = 0; i < V; i++)
                if (logits[i] >= mid) m += e[i];
            if (m >= want) lo = mid;
            else hi = mid;
        }
        n = 0;
        for (int i = 0; i < V; i++)
            if (logits[i] >= lo) s->idx[n++] = i;
        t_sort_vals = logits;
        qsort(s->idx, (size_t)n, sizeof(int32_t), cmp_desc);
    } else {
        n = 0;
        for (int i = 0; i < V; i++) s->idx[n++] = i;  // min-p alone: no order needed below
    }
    if (has_p) {
        double sum = 0, cum = 0;
        for (int i = 0; i < n; i++) sum += e[s->idx[i]];
        if (!has_k) sum = total;  // the candidates hold only part of the mass
        for (int i = 0; i < n; i++) {
            cum += e[s->idx[i]] / sum;
            if (cum >= p->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0) {
        // Keep tokens whose probability is at least min_p times the top token's.
        float thresh = mx + logf(p->min_p);
        int keep = 0;
        for (int i = 0; i < n; i++)
            if (logits[s->idx[i]] >= thresh) s->idx[keep++] = s->idx[i];
        n = keep;
    }
    // The survivors are in value order after top-k / top-p: draw in id order.
    if (has_k || has_p) qsort(s->idx, (size_t)n, sizeof(int32_t), cmp_id);
    return n;
}

static int32_t sample_random(pd_sampler *s, float *logits) {
    int n = select_candidates(s, logits);
    return draw(s, s->ex, s->idx, n);
}

int32_t pd_sampler_sample(pd_sampler *s, float *logits, pd_sample_result *out) {
    const pd_sampling_params *p = &s->p;
    int V = s->vocab;
    pd_sample_result local;
    if (!out) out = &local;
    memset(out, 0, sizeof *out);
    bool want_lp = p->n_logprobs >= 0;
    if (want_lp && !s->raw) s->raw = pd_malloc(sizeof(float) * (size_t)V);
    if (want_lp && s->raw) memcpy(s->raw, logits, sizeof(float) * (size_t)V);
    if (pd_sampler_has_mask(s)) apply_mask(s, logits);
    apply_penalties(s, logits);
    if (s->ctl && s->ctl->n_bias) apply_bias(s, logits);
    int32_t token = p->temperature == 0.0f ? pd_argmax(logits, V) : sample_random(s, logits);
    out->token = token;
    if (want_lp && s->raw) fill_logprobs(s, s->raw, token, out);
    return token;
}

// ---- device sampling ---------------------------------------------------------------------------

static bool has_pres_freq(const pd_sampling_params *p) { return p->presence_penalty != 0 || p->frequency_penalty != 0; }

// Entries: every seen token (repetition penalty; seen is empty when it is off), then generated
// tokens not among them (presence / frequency). One entry per token, as apply_penalties sees it.
// Whether token t already has a penalty entry.
static bool has_pen_entry(const pd_sampler *s, int32_t t) {
    bool rep = s->p.repetition_penalty != 1.0f;
    return (rep && s->seen[t]) || (has_pres_freq(&s->p) && s->out_counts[t] > 0);
}

int pd_sampler_n_pens(const pd_sampler *s) {
    bool rep = s->p.repetition_penalty != 1.0f;
    int n = rep ? s->n_seen : 0;
    if (has_pres_freq(&s->p))
        for (int i = 0; i < s->n_touched; i++) n += !(rep && s->seen[s->touched[i]]);
    for (int i = 0; s->ctl && i < s->ctl->n_bias; i++) {
        int32_t t = s->ctl->bias[i].token;
        n += t >= 0 && t < s->vocab && !has_pen_entry(s, t);
    }
    return n;
}

void pd_sampler_export_row(const pd_sampler *s, int pen_begin, pd_sample_row *row, pd_sample_pen *pens) {
    const pd_sampling_params *p = &s->p;
    *row = (pd_sample_row){.temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p, .min_p = p->min_p,
                           .presence_penalty = p->presence_penalty, .frequency_penalty = p->frequency_penalty,
                           .repetition_penalty = p->repetition_penalty, .seed = s->seed, .draw_idx = s->n_draws,
                           .n_logprobs = p->n_logprobs, .pen_begin = pen_begin, .mask_row = -1};
    int n = 0;
    bool rep = p->repetition_penalty != 1.0f;
    if (rep)
        for (int i = 0; i < s->n_seen; i++) {
            int32_t t = s->seen_ids[i];
            pens[n++] = (pd_sample_pen){.token = t, .count = s->out_counts[t], .is_seen = 1};
        }
    if (has_pres_freq(p))
        for (int i = 0; i < s->n_touched; i++) {
            int32_t t = s->touched[i];
            if (!(rep && s->seen[t])) pens[n++] = (pd_sample_pen){.token = t, .count = s->out_counts[t]};
        }
    // logit_bias: on the token's penalty entry when it has one, else an entry of its own.
    for (int i = 0; s->ctl && i < s->ctl->n_bias; i++) {
        const pd_logit_bias *b = &s->ctl->bias[i];
        if (b->token < 0 || b->token >= s->vocab) continue;
        if (!has_pen_entry(s, b->token)) {
            pens[n++] = (pd_sample_pen){.token = b->token, .bias = b->bias};
            continue;
        }
        for (int k = 0; k < n; k++)
            if (pens[k].token == b->token) {
                pens[k].bias = b->bias;
                break;
            }
    }
    row->n_pens = n;
}

int32_t pd_sampler_import_result(pd_sampler *s, const pd_sample_out *o, pd_sample_result *out) {
    if (s->p.temperature != 0.0f) s->n_draws++;
    if (out) {
        memset(out, 0, sizeof *out);
        out->token = o->token;
        if (s->p.n_logprobs >= 0) {
            out->logprob = o->logprob;
            out->n_top = PD_MIN(o->n_top, PD_MAX_LOGPROBS);
            memcpy(out->top_ids, o->top_ids, sizeof(int32_t) * (size_t)out->n_top);
            memcpy(out->top_logprobs, o->top_logprobs, sizeof(float) * (size_t)out->n_top);
        }
    }
    return o->token;
}

uint64_t pd_sampler_n_draws(const pd_sampler *s) { return s->n_draws; }
void pd_sampler_set_n_draws(pd_sampler *s, uint64_t n) { s->n_draws = n; }

// ---- speculative decoding ----------------------------------------------------------------------
//
// Speculative draws never touch the plain stream (seed, n_draws): each has its own stream, indexed
// by the output position the token would take (n_accepted tokens so far), so a draw is a pure
// function of (seed, stream, position) whatever the step structure was.
enum { STREAM_ACCEPT = 1, STREAM_RESIDUAL = 2, STREAM_DRAFT = 3 };

static uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double spec_uniform(const pd_sampler *s, int stream, int64_t offset) {
    uint64_t seed = mix64(s->seed ^ (0xa0761d6478bd642full * (uint64_t)stream));
    return pd_sample_uniform(seed, (uint64_t)(s->n_out + offset));
}

static int g_spec_broken;  // test hook: see pd_sampler_debug_break_spec
void pd_sampler_debug_break_spec(bool on) { __atomic_store_n(&g_spec_broken, on ? 1 : 0, __ATOMIC_RELAXED); }

bool pd_sampler_is_greedy(const pd_sampler *s) { return s->p.temperature == 0.0f; }

int32_t pd_sampler_probs(pd_sampler *s, float *logits, float *probs) {
    int V = s->vocab;
    apply_penalties(s, logits);
    if (s->p.temperature == 0.0f) {
        int32_t t = pd_argmax(logits, V);
        memset(probs, 0, sizeof(float) * (size_t)V);
        probs[t] = 1.0f;
        return t;
    }
    int n = select_candidates(s, logits);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += s->ex[s->idx[i]];
    memset(probs, 0, sizeof(float) * (size_t)V);
    int32_t best = s->idx[0];
    for (int i = 0; i < n; i++) {
        int32_t t = s->idx[i];
        probs[t] = (float)(s->ex[t] / sum);
        if (probs[t] > probs[best]) best = t;
    }
    return best;
}

// Draws from weights w over ids 0..V-1 in id order with uniform u; -1 if all weights are zero.
static int32_t draw_dense(const float *w, int V, double u) {
    double sum = 0;
    for (int i = 0; i < V; i++) sum += w[i];
    if (!(sum > 0)) return -1;
    double r = u * sum, acc = 0;
    int32_t last = -1;
    for (int i = 0; i < V; i++) {
        if (w[i] <= 0) continue;
        acc += w[i];
        last = i;
        if (r < acc) return i;
    }
    return last;
}

int32_t pd_sampler_draft(pd_sampler *s, float *logits, int offset, float *q) {
    int32_t best = pd_sampler_probs(s, logits, q);
    if (s->p.temperature == 0.0f) return best;
    int32_t t = draw_dense(q, s->vocab, spec_uniform(s, STREAM_DRAFT, offset));
    return t >= 0 ? t : best;
}

int32_t pd_sampler_verify(pd_sampler *s, float *logits, int32_t draft, const float *q, float *scratch, bool *accepted,
                          pd_sample_result *out) {
    int V = s->vocab;
    pd_sample_result local;
    if (!out) out = &local;
    memset(out, 0, sizeof *out);
    bool want_lp = s->p.n_logprobs >= 0;
    if (want_lp && !s->raw) s->raw = pd_malloc(sizeof(float) * (size_t)V);
    if (want_lp && s->raw) memcpy(s->raw, logits, sizeof(float) * (size_t)V);
    float *p = scratch;
    int32_t best = pd_sampler_probs(s, logits, p);
    int32_t token;
    if (s->p.temperature == 0.0f) {
        // Greedy: the target's argmax, exactly as plain decoding picks it.
        *accepted = best == draft;
        token = best;
    } else {
        // Leviathan et al. / Chen et al.: accept x ~ q with probability min(1, p(x) / q(x)); else
        // draw from norm(max(0, p - q)). A draft-free proposal (q NULL) is a point mass at x.
        double qx = q ? (double)q[draft] : 1.0, px = draft >= 0 && draft < V ? (double)p[draft] : 0.0;
        double u = spec_uniform(s, STREAM_ACCEPT, 0);
        *accepted = qx > 0 && u * qx < px;
        if (*accepted) {
            token = draft;
        } else {
            if (!__atomic_load_n(&g_spec_broken, __ATOMIC_RELAXED)) {
                for (int i = 0; i < V; i++) {
                    float r = p[i] - (q ? q[i] : (i == draft ? 1.0f : 0.0f));
                    p[i] = r > 0 ? r : 0;
                }
            }  // broken (tests only): resample from p itself, the classic bias towards x
            token = draw_dense(p, V, spec_uniform(s, STREAM_RESIDUAL, 0));
            if (token < 0) token = best;  // p == q exactly: any x was accepted with probability 1
        }
    }
    out->token = token;
    if (want_lp && s->raw) fill_logprobs(s, s->raw, token, out);
    return token;
}
