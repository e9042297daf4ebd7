// spec.c — see spec.h.
#include "spec/spec.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

static const char *const NAMES[PD_SPEC_N] = {"none", "draft", "ngram", "lookahead"};

const char *pd_spec_method_name(pd_spec_method m) { return (unsigned)m < PD_SPEC_N ? NAMES[m] : "unknown"; }

pd_status pd_spec_method_parse(const char *s, pd_spec_method *out) {
    for (int i = 0; i < PD_SPEC_N; i++)
        if (s && !strcmp(s, NAMES[i])) {
            *out = (pd_spec_method)i;
            return PD_OK;
        }
    return PD_ERR_INVALID;
}

// ---- n-gram prompt lookup ------------------------------------------------------------------------

// k tokens from toks[from..], continued periodically past the end: the text from `from` on is
// predicted to repeat with period n_toks - from, so token from + j >= n_toks is the proposal's own
// token from + j - n_toks (a short loop, period < k, still gets k).
static int copy_from(const int32_t *toks, int n_toks, int from, int k, int32_t *out) {
    for (int j = 0; j < k; j++) out[j] = from + j < n_toks ? toks[from + j] : out[from + j - n_toks];
    return k;
}

// Where the tokens after the most recent earlier occurrence of toks' last n tokens start (n from
// n_max down to n_min), or -1.
static int ngram_match(const int32_t *toks, int n_toks, int n_min, int n_max) {
    if (n_min < 1) return -1;
    for (int n = PD_MIN(n_max, n_toks - 1); n >= n_min; n--) {
        const int32_t *tail = toks + n_toks - n;
        // Most recent earlier occurrence: its start i < n_toks - n, so at least one token follows.
        for (int i = n_toks - n - 1; i >= 0; i--)
            if (!memcmp(toks + i, tail, sizeof(int32_t) * (size_t)n)) return i + n;
    }
    return -1;
}

int pd_spec_ngram_propose(const int32_t *toks, int n_toks, int n_min, int n_max, int k, int32_t *out) {
    return pd_spec_ngram_propose_at(toks, n_toks, n_min, n_max, k, -1, out, NULL);
}

int pd_spec_ngram_propose_at(const int32_t *toks, int n_toks, int n_min, int n_max, int k, int hint, int32_t *out, int *src) {
    if (src) *src = -1;
    if (k <= 0) return 0;
    int from = ngram_match(toks, n_toks, n_min, n_max);
    if (from < 0) from = hint >= 1 && hint < n_toks ? hint : -1;
    if (from < 0) return 0;
    if (src) *src = from;
    return copy_from(toks, n_toks, from, k, out);
}

// ---- lookahead pool ------------------------------------------------------------------------------
// Open addressing over the key token; each key keeps its PER_KEY newest n-grams (newest first).
// When the table is full the probe's last slot is overwritten: the pool is a cache of guesses.
#define POOL_SLOTS 1024
#define PER_KEY 4
#define PROBE 8

typedef struct pool_slot {
    int32_t key;  // -1 = empty
    int32_t n;
    int32_t g[PER_KEY][PD_SPEC_MAX_N - 1];
} pool_slot;

struct pd_spec_pool {
    int N, size;
    pool_slot slots[POOL_SLOTS];
};

pd_spec_pool *pd_spec_pool_new(int N) {
    if (N < 2 || N > PD_SPEC_MAX_N) return NULL;
    pd_spec_pool *p = pd_malloc(sizeof *p);
    if (!p) return NULL;
    p->N = N;
    p->size = 0;
    for (int i = 0; i < POOL_SLOTS; i++) p->slots[i].key = -1, p->slots[i].n = 0;
    return p;
}

void pd_spec_pool_free(pd_spec_pool *p) { pd_free(p); }

static uint32_t key_hash(int32_t key) { return ((uint32_t)key * 2654435761u) >> 22; }  // 10 bits

static pool_slot *pool_find(pd_spec_pool *p, int32_t key, bool create) {
    uint32_t h = key_hash(key);
    pool_slot *last = NULL;
    for (int i = 0; i < PROBE; i++) {
        pool_slot *s = &p->slots[(h + (uint32_t)i) & (POOL_SLOTS - 1)];
        if (s->key == key) return s;
        if (s->key < 0) {
            if (!create) return NULL;
            s->key = key;
            s->n = 0;
            return s;
        }
        last = s;
    }
    if (!create) return NULL;
    p->size -= last->n;  // evict
    last->key = key;
    last->n = 0;
    return last;
}

void pd_spec_pool_add(pd_spec_pool *p, const int32_t *g) {
    if (g[0] < 0) return;
    pool_slot *s = pool_find(p, g[0], true);
    int L = p->N - 1, at = s->n < PER_KEY ? s->n : PER_KEY - 1;
    for (int i = 0; i < s->n; i++)
        if (!memcmp(s->g[i], g + 1, sizeof(int32_t) * (size_t)L)) {
            at = i;  // already there: move it to the front
            break;
        }
    if (at == s->n) {
        s->n++;
        p->size++;
    }
    memmove(s->g[1], s->g[0], sizeof s->g[0] * (size_t)at);
    memcpy(s->g[0], g + 1, sizeof(int32_t) * (size_t)L);
}

int pd_spec_pool_propose(const pd_spec_pool *p, int32_t key, int k, int32_t *out) {
    const pool_slot *s = pool_find((pd_spec_pool *)p, key, false);
    if (!s || s->n == 0 || k <= 0) return 0;
    int m = PD_MIN(k, p->N - 1);
    memcpy(out, s->g[0], sizeof(int32_t) * (size_t)m);
    return m;
}

int pd_spec_pool_size(const pd_spec_pool *p) { return p->size; }

// ---- Jacobi window -------------------------------------------------------------------------------

void pd_spec_jacobi_init(pd_spec_jacobi *j, int W, int N, const int32_t *ctx, int n_ctx) {
    memset(j, 0, sizeof *j);
    j->W = PD_MAX(1, PD_MIN(W, PD_SPEC_MAX_W));
    j->N = PD_MAX(2, PD_MIN(N, PD_SPEC_MAX_N));
    j->n_hist = 1;
    for (int i = 0; i < j->W; i++) j->hist[0][i] = n_ctx > 0 ? ctx[(int64_t)i * 7919 % n_ctx] : 0;
}

const int32_t *pd_spec_jacobi_window(const pd_spec_jacobi *j) { return j->hist[j->n_hist - 1]; }

void pd_spec_jacobi_step(pd_spec_jacobi *j, const int32_t *pred, pd_spec_pool *pool) {
    int W = j->W, N = j->N;
    if (j->n_hist == N - 1 + 1) {  // keep N - 1 past windows plus the new one
        memmove(j->hist[0], j->hist[1], sizeof j->hist[0] * (size_t)(j->n_hist - 1));
        j->n_hist--;
    }
    memcpy(j->hist[j->n_hist++], pred, sizeof(int32_t) * (size_t)W);
    if (!pool || j->n_hist < N) return;
    // Iteration t's window token i is followed, one iteration later, by the model's guess for the
    // next position at i + 1 (given that very token): the diagonals are n-grams.
    int32_t g[PD_SPEC_MAX_N];
    for (int i = 0; i + N - 1 < W; i++) {
        for (int d = 0; d < N; d++) g[d] = j->hist[d][i + d];
        pd_spec_pool_add(pool, g);
    }
}

// ---- adaptive length -----------------------------------------------------------------------------

#define ACCEPT_PRIOR_WEIGHT 2.0

void pd_spec_accept_init(pd_spec_accept *a, double prior_alpha) {
    a->s = a->ss = ACCEPT_PRIOR_WEIGHT * prior_alpha;
    a->f = a->fs = ACCEPT_PRIOR_WEIGHT * (1 - prior_alpha);
}

// Whether the short memory's estimate is inconsistent with the long one's: |as - al| > z standard
// errors of a proportion estimated from the short memory's observations (at least one).
static bool accept_changed(const pd_spec_accept *a) {
    double tl = a->s + a->f, ts = a->ss + a->fs;
    if (tl <= 0 || ts <= 0) return false;
    double al = a->s / tl, as = a->ss / ts, var = al * (1 - al);
    double d = as - al, n = ts > 1 ? ts : 1;
    // var floored at one observation's worth of either outcome: an estimate at 0 or 1 must not
    // make every later difference infinitely significant.
    double vf = 1.0 / (n + 1);
    if (var < vf * (1 - vf)) var = vf * (1 - vf);
    return d * d * n > PD_SPEC_ACCEPT_Z * PD_SPEC_ACCEPT_Z * var;
}

void pd_spec_accept_update(pd_spec_accept *a, int n_drafted, int n_accepted) {
    if (n_drafted <= 0) return;
    double fail = n_accepted < n_drafted ? 1 : 0;
    a->s = PD_SPEC_ACCEPT_DECAY_LONG * a->s + n_accepted;
    a->f = PD_SPEC_ACCEPT_DECAY_LONG * a->f + fail;
    a->ss = PD_SPEC_ACCEPT_DECAY_SHORT * a->ss + n_accepted;
    a->fs = PD_SPEC_ACCEPT_DECAY_SHORT * a->fs + fail;
    if (accept_changed(a)) {  // a real change: restart from the recent steps' estimate, lightly held
        double ts = a->ss + a->fs, w = ts < PD_SPEC_ACCEPT_RESTART_W ? ts : PD_SPEC_ACCEPT_RESTART_W;
        a->s = w * a->ss / ts, a->f = w * a->fs / ts;
    }
}

double pd_spec_accept_alpha(const pd_spec_accept *a) {
    double t = a->s + a->f;
    return t > 0 ? a->s / t : 0;
}

double pd_spec_accept_evidence(const pd_spec_accept *a, double prior_evidence) {
    double e = a->s + a->f + (prior_evidence >= 0 ? prior_evidence : -ACCEPT_PRIOR_WEIGHT);
    return e > 0 ? e : 0;
}

void pd_spec_prior_init(pd_spec_prior *p) { p->sum = p->w = 0, p->n = 0; }

void pd_spec_prior_add(pd_spec_prior *p, int64_t n_steps, int64_t n_accepted, int64_t n_fail) {
    if (n_steps < PD_SPEC_PRIOR_MIN_STEPS || n_accepted < 0 || n_fail < 0 || n_accepted + n_fail <= 0) return;
    double a = (double)n_accepted / (double)(n_accepted + n_fail);
    p->sum = PD_SPEC_PRIOR_DECAY * p->sum + a;
    p->w = PD_SPEC_PRIOR_DECAY * p->w + 1;
    p->n++;
}

double pd_spec_prior_get(const pd_spec_prior *p) { return p->n >= PD_SPEC_PRIOR_MIN && p->w > 0 ? p->sum / p->w : -1; }

#define COST_DECAY 0.98

void pd_spec_cost_init(pd_spec_cost *c, double step_us_prior) {
    memset(c, 0, sizeof *c);
    c->draft_us = -1;
    // Optimistic prior (a memory-bound step: 1% more per extra token), weight 2: measured steps
    // replace it within a few dozen steps. Optimism lets speculation run and be measured at all.
    double a = step_us_prior > 0 ? step_us_prior : 1000;
    for (int i = 0; i < 2; i++) {
        double x = i == 0 ? 1 : 64, y = a * (1 + 0.01 * (x - 1));
        c->w += 1, c->sx += x, c->sy += y, c->sxx += x * x, c->sxy += x * y;
    }
}

void pd_spec_cost_observe(pd_spec_cost *c, int n_tokens, double us) {
    if (n_tokens <= 0 || !(us > 0)) return;
    double x = n_tokens;
    c->w = COST_DECAY * c->w + 1;
    c->sx = COST_DECAY * c->sx + x;
    c->sy = COST_DECAY * c->sy + us;
    c->sxx = COST_DECAY * c->sxx + x * x;
    c->sxy = COST_DECAY * c->sxy + x * us;
    c->n_obs++;
}

void pd_spec_cost_observe_draft(pd_spec_cost *c, double us) {
    if (!(us > 0)) return;
    c->draft_us = c->draft_us < 0 ? us : 0.8 * c->draft_us + 0.2 * us;
}

double pd_spec_cost_predict(const pd_spec_cost *c, int n_tokens) {
    double mx = c->sx / c->w, my = c->sy / c->w;
    double var = c->sxx / c->w - mx * mx, cov = c->sxy / c->w - mx * my;
    double b = var > 1e-9 ? cov / var : 0;
    if (b < 0) b = 0;  // more tokens never cost less
    double a = my - b * mx;
    double t = a + b * n_tokens;
    double floor_us = my * 0.05;  // noise guard: a step is never predicted (near) free
    return t > floor_us ? t : floor_us;
}

int pd_spec_choose(const pd_spec_cost *c, int n_base, int n_seqs, const double *alpha, const int *k_max,
                   bool uses_draft, int *k) {
    double d = c->draft_us > 0 ? c->draft_us : 0;
    pd_spec_draft_price dp = {d, d};
    return pd_spec_choose_padded(c, n_base, n_seqs, n_seqs, alpha, k_max, uses_draft ? &dp : NULL, NULL, NULL, k);
}

int pd_spec_choose_padded(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                          const pd_spec_draft_price *draft, pd_spec_step_cost_fn pad, void *ud, int *k) {
    return pd_spec_choose_padded_m(c, n_base, n_seqs, n_yield, alpha, k_max, draft, pad, ud, k, -1);
}

int pd_spec_choose_padded_m(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                            const pd_spec_draft_price *draft, pd_spec_step_cost_fn pad, void *ud, int *k, double min_gain) {
    return pd_spec_choose_padded_f(c, n_base, n_seqs, n_yield, alpha, k_max, draft, pad, ud, k, min_gain, 1);
}

int pd_spec_choose_padded_f(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const double *alpha, const int *k_max,
                            const pd_spec_draft_price *draft, pd_spec_step_cost_fn pad, void *ud, int *k, double min_gain,
                            double factor) {
    if (!(min_gain >= 0)) min_gain = PD_SPEC_MIN_GAIN;
    if (!(factor > 0)) factor = 1;
    double d1 = draft && draft->first_us > 0 ? draft->first_us : 0, dn = draft && draft->next_us > 0 ? draft->next_us : 0;
    int sum_k = 0, max_k = 0;
    double tokens = n_yield > n_seqs ? n_yield : n_seqs;  // every sequence yields its target token anyway
    for (int i = 0; i < n_seqs; i++) k[i] = 0;
    double cost = pad ? pad(ud, 0, n_base) : pd_spec_cost_predict(c, n_base);
    // With padding: the best point of the greedy path (its length in added tokens).
    double best_rate = tokens / cost;
    int best_len = 0, len = 0;
    int order_stack[512], *order = NULL;  // which sequence each step of the path grew (replayed up to best_len)
    if (pad) {
        int total = 0;
        for (int i = 0; i < n_seqs; i++) total += k_max[i] > 0 ? k_max[i] : 0;
        order = total <= 512 ? order_stack : pd_malloc(sizeof(int) * (size_t)total);
        if (!order) return 0;  // out of memory: no speculation this step
    }
    // g[i]: sequence i's next marginal gain alpha^(k+1), updated by one product per step (this
    // loop runs up to sum(k_max) times over n_seqs sequences: no pow() in it).
    double g_stack[256], *g = n_seqs <= 256 ? g_stack : pd_malloc(sizeof(double) * (size_t)n_seqs);
    if (!g) {
        if (order && order != order_stack) pd_free(order);
        return 0;
    }
    for (int i = 0; i < n_seqs; i++) g[i] = alpha[i] > 0 ? alpha[i] : 0;
    for (;;) {
        // The sequence with the largest marginal gain alpha^(k+1).
        int best = -1;
        double gain = 0;
        for (int i = 0; i < n_seqs; i++)
            if (k[i] < k_max[i] && g[i] > gain) gain = g[i], best = i;
        // Below 0.005 expected tokens a draft cannot pay for anything (the path stops there).
        if (best < 0 || gain <= (pad ? 0.005 : 0)) break;
        g[best] *= alpha[best];
        int nk = k[best] + 1, nmax = nk > max_k ? nk : max_k;
        int n_tok = n_base + sum_k + 1;
        double ncost = (pad ? pad(ud, nmax, n_tok) : pd_spec_cost_predict(c, n_tok)) + d1 + (nmax - 1) * dn;
        if (!pad && (tokens + gain) / ncost <= tokens / cost) break;  // does not pay: neither will the rest
        k[best] = nk;
        sum_k++;
        max_k = nmax;
        tokens += gain;
        cost = ncost;
        if (pad) {
            order[len++] = best;
            if (tokens / cost > best_rate) best_rate = tokens / cost, best_len = len;
        }
    }
    if (g != g_stack) pd_free(g);
    if (pad) {
        // Every sequence at min(m, k_max): in a padded step whose cost depends on the longest
        // draft m alone (graphs; the draft's forwards run for the batch), every draft up to m
        // rides free, so for each m this is the best point with that m — which the greedy path,
        // growing the sequences with the highest estimates first, may pass by (it reached k = 4
        // for a few sequences, a Q = 5 step, before k = 1 for the others: session 11, batch 64).
        double base_tokens = n_yield > n_seqs ? n_yield : n_seqs;
        int best_m = -1, kmx = 0;
        for (int i = 0; i < n_seqs; i++) kmx = k_max[i] > kmx ? k_max[i] : kmx;
        for (int m = 1; m <= kmx; m++) {
            double t = base_tokens;
            int n_tok = n_base;
            for (int i = 0; i < n_seqs; i++) {
                int ki = k_max[i] < m ? k_max[i] : m;
                double p = 1;
                for (int j = 0; j < ki; j++) p *= alpha[i] > 0 ? alpha[i] : 0, t += p;
                n_tok += ki > 0 ? ki : 0;
            }
            double r = t / (pad(ud, m, n_tok) + d1 + (m - 1) * dn);
            if (r > best_rate) best_rate = r, best_m = m;
        }
        // ... and drafts only where the best beats drafting nothing by the margin.
        bool pays = factor * best_rate >= (1.0 + min_gain) * base_tokens / pad(ud, 0, n_base);
        sum_k = 0;
        for (int i = 0; i < n_seqs; i++) k[i] = 0;
        if (pays && best_m > 0) {
            for (int i = 0; i < n_seqs; i++) k[i] = k_max[i] < best_m ? (k_max[i] > 0 ? k_max[i] : 0) : best_m, sum_k += k[i];
        } else if (pays) {
            for (int j = 0; j < best_len; j++) k[order[j]]++;
            sum_k = best_len;
        }
        if (order != order_stack) pd_free(order);
    }
    return sum_k;
}

// ---- a draining batch's finish time ----------------------------------------------------------

void pd_spec_step_moments(double alpha, int k, double *mean, double *var) {
    double a = alpha > 0 ? (alpha < 1 ? alpha : 1) : 0, p = 1, m1 = 0, m2 = 0;
    for (int j = 1; j <= k; j++) {
        p *= a;  // P(A >= j): drafts 1..j accepted
        m1 += p;
        m2 += (2 * j - 1) * p;  // E[A^2] = sum_j (2j - 1) P(A >= j)
    }
    *mean = 1 + m1;
    double v = m2 - m1 * m1;
    *var = v > 0 ? v : 0;
}

// The standard normal distribution function (Abramowitz & Stegun 26.2.17, |error| < 7.5e-8).
static double norm_cdf_exact(double x) {
    if (x > 8.3) return 1;  // 1 - Phi(8.3) < 1e-16
    if (x < -8.3) return 0;
    double ax = fabs(x), t = 1 / (1 + 0.2316419 * ax);
    double poly = t * (0.319381530 + t * (-0.356563782 + t * (1.781477937 + t * (-1.821255978 + t * 1.330274429))));
    double q = 0.3989422804014327 * exp(-0.5 * ax * ax) * poly;
    return x >= 0 ? 1 - q : q;
}

// The same from a table at 1/32 steps over [-8.5, 8.5], interpolated linearly (|error| < 3e-5: the
// drain model evaluates it n x (DRAIN_GRID + 1) times per cap, ~2100 at batch 64: a table lookup
// instead of an exp() halves the model's host time). Filled once (pthread_once).
#define PHI_STEPS 32
#define PHI_MAX 8.5
#define PHI_N 546  // 2 * PHI_MAX * PHI_STEPS + 2
static double phi_tab[PHI_N];
static pthread_once_t phi_once = PTHREAD_ONCE_INIT;

static void phi_fill(void) {
    for (int i = 0; i < PHI_N; i++) phi_tab[i] = norm_cdf_exact(-PHI_MAX + (double)i / PHI_STEPS);
}

static double norm_cdf(double x) {
    if (x >= PHI_MAX) return 1;
    if (x <= -PHI_MAX) return 0;
    double u = (x + PHI_MAX) * PHI_STEPS;
    int i = (int)u;
    double f = u - i;
    return phi_tab[i] + f * (phi_tab[i + 1] - phi_tab[i]);
}

// E[max] of independent normals: lo = max_i (mu_i - DRAIN_Z s_i) (the maximum lies below it with
// probability < Phi(-DRAIN_Z)), E[max] = lo + integral over [lo, hi] of P(max > x), hi = max_i
// (mu_i + DRAIN_Z s_i); only sequences whose mu + DRAIN_Z s exceeds lo can be last (the others'
// Phi is 1 there). The trapezoid rule over DRAIN_GRID intervals (~0.3 s apart at the widest).
#define DRAIN_Z 5.0
#define DRAIN_GRID 32

double pd_spec_drain_steps(int n, const int *R, const double *alpha, const int *k) {
    pthread_once(&phi_once, phi_fill);
    double mu_stack[256], *mu = n <= 128 ? mu_stack : pd_malloc(sizeof(double) * 2 * (size_t)n), *sd = mu + (n <= 128 ? 128 : n);
    if (!mu) return -1;
    double lo = 0, hi = 0;
    int any = 0;
    for (int i = 0; i < n; i++) {
        mu[i] = sd[i] = 0;
        if (R[i] <= 0) continue;
        double m = 1, v = 0;
        if (k[i] > 0) pd_spec_step_moments(alpha[i], k[i], &m, &v);
        // (No overshoot past R: the scheduler caps a step's drafts at the budget left.)
        mu[i] = R[i] / m;
        sd[i] = sqrt(R[i] * v / (m * m * m));
        double l = mu[i] - DRAIN_Z * sd[i], h = mu[i] + DRAIN_Z * sd[i];
        if (!any || l > lo) lo = l;
        if (!any || h > hi) hi = h;
        any = 1;
    }
    double e = lo;
    if (any && hi > lo) {
        // The sequences that can be last, compacted to the front.
        int nc = 0;
        for (int i = 0; i < n; i++)
            if (R[i] > 0 && sd[i] > 0 && mu[i] + DRAIN_Z * sd[i] > lo) mu[nc] = mu[i], sd[nc] = 1 / sd[i], nc++;  // sd now 1/sd
        double h = (hi - lo) / DRAIN_GRID, sum = 0;
        for (int g = 0; g <= DRAIN_GRID; g++) {
            double x = lo + g * h, p = 1;
            for (int i = 0; i < nc && p > 1e-15; i++) p *= norm_cdf((x - mu[i]) * sd[i]);
            sum += (g == 0 || g == DRAIN_GRID ? 0.5 : 1) * (1 - p);
        }
        e = lo + sum * h;
    }
    if (mu != mu_stack) pd_free(mu);
    return any ? e : 0;
}

int pd_spec_drain_choose(int n, const int *R, const double *alpha, int *k, const double *cost, double min_gain, double *ratio) {
    return pd_spec_drain_choose_f(n, R, alpha, k, cost, min_gain, 1, ratio);
}

int pd_spec_drain_choose_f(int n, const int *R, const double *alpha, int *k, const double *cost, double min_gain, double factor,
                           double *ratio) {
    if (!(min_gain >= 0)) min_gain = PD_SPEC_DRAIN_MIN_GAIN;
    if (!(factor > 0)) factor = 1;
    if (ratio) *ratio = 1;
    int M = 0, plain = 0;
    for (int i = 0; i < n; i++) {
        M = k[i] > M ? k[i] : M;
        plain = R[i] > plain ? R[i] : plain;
    }
    if (M <= 0) return 0;
    if (plain <= 0 || !(cost[0] > 0)) return M;  // nothing to finish: the per-step choice stands
    int kk_stack[256], *kk = n <= 256 ? kk_stack : pd_malloc(sizeof(int) * (size_t)n);
    if (!kk) return M;  // out of memory: the per-step choice stands
    double plain_t = plain * cost[0], best_t = -1;
    int best_m = 0;
    for (int m = 1; m <= M; m++) {
        for (int i = 0; i < n; i++) kk[i] = k[i] < m ? k[i] : m;
        double steps = pd_spec_drain_steps(n, R, alpha, kk);
        if (steps < 0) continue;
        double t = steps * cost[m];
        if (best_m == 0 || t < best_t) best_t = t, best_m = m;
    }
    if (kk != kk_stack) pd_free(kk);
    if (best_m == 0) return M;
    if (ratio) *ratio = best_t / plain_t;
    bool pays = factor * plain_t >= (1 + min_gain) * best_t;
    for (int i = 0; i < n; i++) k[i] = pays ? (k[i] < best_m ? k[i] : best_m) : 0;
    return pays ? best_m : 0;
}

// ---- a decision to draft needs evidence ---------------------------------------------------------

double pd_spec_uninformed_alpha(int64_t n_acc, int64_t n_fail, double prior) {
    if (n_acc < 0) n_acc = 0;
    if (n_fail < 0) n_fail = 0;
    return ((double)n_acc + PD_SPEC_UNINFORMED_W * prior) / ((double)(n_acc + n_fail) + PD_SPEC_UNINFORMED_W);
}

double pd_spec_pooled_bound(int n, const double *alpha, const double *e, double z, double *mean) {
    if (mean) *mean = 0;
    if (n <= 0) return 0;
    double m = 0, inv = 0;
    for (int i = 0; i < n; i++) {
        m += alpha[i];
        inv += 1.0 / (e[i] > 1 ? e[i] : 1);
    }
    m /= n;
    if (mean) *mean = m;
    if (n == 1) return m;
    double var = m * (1 - m) * inv / ((double)n * n);
    double lo = m - (z > 0 ? z : 0) * sqrt(var > 0 ? var : 0);
    return lo > 0 ? lo : 0;
}

int pd_spec_drain_choose_lb(int n, const int *R, const double *alpha, const double *alpha_lo, int *k, const double *cost,
                            double min_gain, double factor, double *ratio, double *ratio_lo) {
    if (ratio_lo) *ratio_lo = 1;
    if (alpha_lo) {
        int kk_stack[256], *kk = n <= 256 ? kk_stack : pd_malloc(sizeof(int) * (size_t)n);
        if (kk) {
            for (int i = 0; i < n; i++) kk[i] = k[i];
            int m = pd_spec_drain_choose_f(n, R, alpha_lo, kk, cost, min_gain, factor, ratio_lo);
            if (kk != kk_stack) pd_free(kk);
            if (m == 0) {
                // Refused at the bound: the point estimate's ratio for the record, nothing drafts.
                pd_spec_drain_choose_f(n, R, alpha, k, cost, min_gain, factor, ratio);
                for (int i = 0; i < n; i++) k[i] = 0;
                return 0;
            }
        }
    }
    return pd_spec_drain_choose_f(n, R, alpha, k, cost, min_gain, factor, ratio);
}

int pd_spec_explore_cap(bool informed, int64_t n_steps, int k_max, int explore_n, int n_batch) {
    if (informed || explore_n <= 0 || n_steps >= explore_n || n_batch <= 1) return k_max;
    return k_max < 1 ? k_max : 1;
}

// ---- realized against predicted gain ---------------------------------------------------------

void pd_spec_calib_init(pd_spec_calib *c) { memset(c, 0, sizeof *c); }

static int calib_find(const pd_spec_calib *c, uint32_t B) {
    for (int i = 0; i < c->nb; i++)
        if (c->b[i].B == B) return i;
    return -1;
}

void pd_spec_calib_observe(pd_spec_calib *c, uint32_t B, double emitted, double expected, double real_us, double pred_us) {
    if (!B || !(emitted > 0) || !(expected > 0) || !(real_us > 0) || !(pred_us > 0)) return;
    int i = calib_find(c, B);
    if (i < 0) {
        if (c->nb < PD_SPEC_CALIB_BUCKETS) i = c->nb++;
        else {  // full: the bucket seen least often makes room
            i = 0;
            for (int j = 1; j < c->nb; j++)
                if (c->b[j].n < c->b[i].n) i = j;
        }
        memset(&c->b[i], 0, sizeof c->b[i]);
        c->b[i].B = B;
    }
    if (real_us > PD_SPEC_CALIB_CLIP * pred_us) real_us = PD_SPEC_CALIB_CLIP * pred_us;
    if (real_us < pred_us / PD_SPEC_CALIB_CLIP) real_us = pred_us / PD_SPEC_CALIB_CLIP;
    double d = PD_SPEC_CALIB_DECAY;
    c->b[i].emitted = d * c->b[i].emitted + emitted;
    c->b[i].expected = d * c->b[i].expected + expected;
    c->b[i].real_us = d * c->b[i].real_us + real_us;
    c->b[i].pred_us = d * c->b[i].pred_us + pred_us;
    c->b[i].n++;
}

double pd_spec_calib_factor(const pd_spec_calib *c, uint32_t B) {
    int i = calib_find(c, B);
    if (i < 0 || c->b[i].n < PD_SPEC_CALIB_MIN || !(c->b[i].real_us > 0)) return 1;
    double f = c->b[i].pred_us / c->b[i].real_us;
    return f < PD_SPEC_CALIB_LO ? PD_SPEC_CALIB_LO : f > PD_SPEC_CALIB_HI ? PD_SPEC_CALIB_HI : f;
}

double pd_spec_calib_part(const pd_spec_calib *c, uint32_t B, int part) {
    int i = calib_find(c, B);
    if (i < 0 || !(c->b[i].expected > 0) || !(c->b[i].real_us > 0)) return 0;
    return part == 0 ? c->b[i].emitted / c->b[i].expected : c->b[i].pred_us / c->b[i].real_us;
}

double pd_spec_calib_tokens(const pd_spec_calib *c, uint32_t B) {
    int i = calib_find(c, B);
    if (i < 0 || c->b[i].n < PD_SPEC_CALIB_MIN || !(c->b[i].expected > 0)) return 1;
    double f = c->b[i].emitted / c->b[i].expected;
    return f < PD_SPEC_CALIB_LO ? PD_SPEC_CALIB_LO : f > 1 ? 1 : f;
}

int64_t pd_spec_calib_n(const pd_spec_calib *c, uint32_t B) {
    int i = calib_find(c, B);
    return i < 0 ? 0 : c->b[i].n;
}

// ---- measured step times per shape -----------------------------------------------------------

#define SHAPE_PROBE 8
#define SHAPE_EMA 0.2

void pd_spec_shapes_init(pd_spec_shapes *t) {
    memset(t, 0, sizeof *t);
    t->trust_n = PD_SPEC_SHAPE_TRUST;
}

static int shape_slot(const pd_spec_shapes *t, uint32_t key, bool *found) {
    uint32_t h = (key * 2654435761u) >> 24;  // 8 bits: PD_SPEC_SHAPES = 256
    int empty = -1, oldest = -1;
    for (int i = 0; i < SHAPE_PROBE; i++) {
        int s = (int)((h + (uint32_t)i) & (PD_SPEC_SHAPES - 1));
        if (t->key[s] == key) {
            *found = true;
            return s;
        }
        if (!t->key[s] && empty < 0) empty = s;
        if (t->key[s] && (oldest < 0 || t->last[s] < t->last[oldest])) oldest = s;
    }
    *found = false;
    return empty >= 0 ? empty : oldest;
}

void pd_spec_shapes_observe(pd_spec_shapes *t, uint32_t key, double us) {
    if (!key || !(us > 0)) return;
    bool found;
    int s = shape_slot(t, key, &found);
    if (!found) {
        t->key[s] = key;
        t->n[s] = 0;
    }
    // The first step of a shape is not its cost (a graph's first launch uploads it; an eager
    // step of a new size plans its GEMMs: up to 100x a plain step): the second one replaces it.
    // Session 15: steps 2 .. trust_n keep the least of them (a transient only adds time).
    if (t->n[s] >= 2 && t->n[s] < t->trust_n) t->us[s] = us < t->us[s] ? (float)us : t->us[s];
    else t->us[s] = t->n[s] >= 2 ? (float)((1 - SHAPE_EMA) * t->us[s] + SHAPE_EMA * us) : (float)us;
    t->n[s]++;
    t->last[s] = ++t->clock;
}

uint32_t pd_spec_shapes_get_n(const pd_spec_shapes *t, uint32_t key) {
    if (!key) return 0;
    bool found;
    int s = shape_slot(t, key, &found);
    return found ? t->n[s] : 0;
}

double pd_spec_shapes_get(const pd_spec_shapes *t, uint32_t key) {
    if (!key) return -1;
    bool found;
    int s = shape_slot(t, key, &found);
    return found && t->n[s] >= 2 ? t->us[s] : -1;
}

// ---- the draft model's forward cost, per shape ------------------------------------------------

void pd_spec_dcost_init(pd_spec_dcost *d) {
    pd_spec_shapes_init(&d->t);
    d->any_us = -1;
    d->n_obs = 0;
}

static double clip_to(double us, double est) {
    if (!(est > 0)) return us;
    return us > PD_SPEC_DCOST_CLIP * est ? PD_SPEC_DCOST_CLIP * est : us < est / PD_SPEC_DCOST_CLIP ? est / PD_SPEC_DCOST_CLIP : us;
}

void pd_spec_dcost_observe(pd_spec_dcost *d, uint32_t key, double us) {
    if (!key || !(us > 0)) return;
    double est = pd_spec_shapes_get(&d->t, key);  // -1 until the shape's second forward
    bool counted = est > 0 || pd_spec_shapes_get_n(&d->t, key) >= 1;  // the shape's first forward is not a sample
    pd_spec_shapes_observe(&d->t, key, clip_to(us, est));
    if (counted) {
        double v = clip_to(us, d->any_us);
        d->any_us = d->any_us > 0 ? 0.8 * d->any_us + 0.2 * v : v;
    }
    d->n_obs++;
}

double pd_spec_dcost_get(const pd_spec_dcost *d, uint32_t key) {
    double us = pd_spec_shapes_get(&d->t, key);
    return us > 0 ? us : d->any_us;
}

// ---- what resuming and untimed shapes cost ---------------------------------------------------------

int pd_spec_tok_bucket(int t) {
    int r = 1;
    while (r < t && r < (1 << 29)) r = (r & (r - 1)) ? (r / 3) * 4 : (r >= 2 ? r + r / 2 : 2);  // 2^k -> 1.5 * 2^k -> 2^(k+1)
    return r;
}

double pd_spec_catchup_us(const pd_spec_dcost *catchup, int max_tokens, double steady_us, int n, int lag, int max_lag) {
    if (steady_us < 0) steady_us = 0;
    if (max_lag <= 2) return steady_us;
    int T = pd_spec_tok_bucket(lag);
    double c = catchup && T <= max_tokens ? pd_spec_shapes_get(&catchup->t, (uint32_t)T) : -1;
    if (c < 0) c = steady_us * (double)lag / (2.0 * (n > 0 ? n : 1));
    return c > steady_us ? c : steady_us;
}

// The warm-up's price of a shape (pd_spec_shape_us without its live time); -1: none.
static double shape_warm_us(const pd_spec_shapes *live, const pd_spec_shapes *warm, uint32_t key, uint32_t key_plain, double host_us) {
    if (!warm) return -1;
    double w = pd_spec_shapes_get(warm, key), w1 = pd_spec_shapes_get(warm, key_plain), l1 = pd_spec_shapes_get(live, key_plain);
    if (w > 0 && host_us >= 0) return w + host_us;
    if (!(w > 0) || !(w1 > 0)) return -1;
    return (l1 > 0 ? l1 : w1) + (w > w1 ? w - w1 : 0);
}

double pd_spec_shape_us(const pd_spec_shapes *live, const pd_spec_shapes *warm, uint32_t key, uint32_t key_plain, double host_us) {
    double us = pd_spec_shapes_get(live, key);
    if (us > 0 && pd_spec_shapes_get_n(live, key) < live->trust_n && key != key_plain) {
        double wu = shape_warm_us(live, warm, key, key_plain, host_us);
        if (wu > 0 && wu < us) return wu;  // not confirmed yet: the warm-up's price stands
    }
    if (us > 0) return us;
    return shape_warm_us(live, warm, key, key_plain, host_us);
}

int pd_spec_nomatch_wait(int n_miss) {
    if (n_miss < 1) n_miss = 1;
    return n_miss > PD_SPEC_NOMATCH_RETRIES ? -1 : 1 << (n_miss - 1);
}

// ---- probes ------------------------------------------------------------------------------------

bool pd_spec_probe_worth(const pd_spec_cost *c, int n_base, int n_seqs, int n_yield, const int *k_max,
                         const pd_spec_draft_price *draft, pd_spec_step_cost_fn cost, void *ud, int *k) {
    if (n_seqs <= 0) return false;
    double one_stack[256], *one = n_seqs <= 256 ? one_stack : pd_malloc(sizeof(double) * (size_t)n_seqs);
    if (!one) return false;
    for (int i = 0; i < n_seqs; i++) one[i] = 1.0;
    int sum = pd_spec_choose_padded(c, n_base, n_seqs, n_yield, one, k_max, draft, cost, ud, k);
    if (one != one_stack) pd_free(one);
    return sum > 0;
}

double pd_spec_probe_base(double probe_us, double step_us, double share) {
    double p = probe_us / (share * (step_us > 1 ? step_us : 1));
    if (!(p >= PD_SPEC_PERIOD_MIN)) return PD_SPEC_PERIOD_MIN;  // (also NaN)
    return p > PD_SPEC_PROBE_BASE_MAX ? PD_SPEC_PROBE_BASE_MAX : p;
}

void pd_spec_backoff_init(pd_spec_backoff *b) { b->mult = 1; }

int64_t pd_spec_backoff_period(const pd_spec_backoff *b, double base) {
    if (!(base >= PD_SPEC_PERIOD_MIN)) base = PD_SPEC_PERIOD_MIN;  // (also NaN)
    double p = base * (double)b->mult;
    return p > PD_SPEC_PERIOD_MAX ? PD_SPEC_PERIOD_MAX : (int64_t)p;
}

void pd_spec_backoff_result(pd_spec_backoff *b, bool success) {
    if (success) b->mult = 1;
    else if (b->mult < PD_SPEC_BACKOFF_MAX) b->mult *= 2;
}
