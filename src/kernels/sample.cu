// sample.cu — one token per row of f32 logits, on the device, with the CPU sampler's semantics
// (src/model/sample.c): penalties → temperature → top-k → top-p → min-p → draw; logprobs of the
// raw logits; greedy ties to the lowest id.
//
// One CTA of 1024 threads per row; the row (up to ~152k floats) is re-read from L2 by each pass
// instead of being sorted. Passes, each skipped when the row does not need it:
//
//   A  raw log-sum-exp (online max + sum)          logprobs
//      radix select of the N-th largest raw logit  top-N logprobs, then an ordered gather
//   B  penalties and logit bias in place (sparse entries; the overwritten values are saved in
//      pen_raw). A row with a token mask reads every disallowed token as -inf in C (lg()), so the
//      mask is never written into the logits.
//   C  greedy: block argmax.  Random: max of l = x * (1/T), then
//      top-k: radix select of the k-th largest l (counts)
//      top-p: radix select by probability mass (restricted to the top-k set)
//      min-p: a value threshold, mx + log(min_p)
//      S: the surviving mass; draw: u * S located by a block-wide inclusive scan in id order
//   D  penalties undone (pen_raw), the token's raw logprob
//
// Every truncation keeps a prefix of the order (value desc, id asc), so the survivors are "key >
// Kc, plus the first jc tokens (by id) whose key equals Kc". The radix select works on the 32-bit
// order-preserving key of the float, 8 bits a pass (4 passes), with per-warp-pair shared-memory
// histograms (double weights: counts, or exp masses), so that the clustered high digits of real
// logits do not serialise on one address. Element
// arithmetic matches the CPU bit for bit where it can (no FMA contraction: __fmul_rn / __fadd_rn;
// exp computed in double and rounded to float like glibc's expf; 1/T and logf(min_p) come from
// the host), so seeded draws agree except when u*S lands within rounding of a boundary.
#include <math.h>

#include "kernels/common.cuh"
#include "kernels/sample.cuh"
#include "kernels/sample_rng.h"

#define NT 1024
#define NWARP (NT / 32)
#define RADIX 256
#define NHIST 16            // histogram copies: warps 2c and 2c+1 share copy c
#define ITEMS 4             // consecutive elements per thread in the ordered (id-order) passes
#define TILE (NT * ITEMS)
#define FULL 0xffffffffu

struct k_smem {
    double hist[NHIST][RADIX];
    double tot[RADIX];
    double red_d[NWARP];
    float red_f[NWARP];
    int red_i[NWARP];
    double scan_d[NWARP];
    int scan_i[NWARP];
    int sel_digit;
    double sel_above, sel_eq;
    int token, last_keep, n_top;
    int top_ids[PD_SAMPLE_KMAX_TOP];
    float top_vals[PD_SAMPLE_KMAX_TOP];
};

// ---- element helpers ---------------------------------------------------------------------------

// Order-preserving key: a > b as floats <=> key(a) > key(b) (both zeros map to +0).
static __device__ __forceinline__ uint32_t fkey(float f) {
    uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static __device__ __forceinline__ float fval(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// exp(l - mx) as the CPU computes expf: the float difference, exp in double, rounded once.
static __device__ __forceinline__ float elem_e(float l, float mx) { return (float)exp((double)__fsub_rn(l, mx)); }

// ---- block reductions and scans (every thread calls; every thread gets the result) -------------

static __device__ double blk_sum_d(double v, k_smem &S) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    __syncthreads();
    if (lane == 0) S.red_d[warp] = v;
    __syncthreads();
    v = S.red_d[lane];
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

static __device__ int blk_sum_i(int v, k_smem &S) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    __syncthreads();
    if (lane == 0) S.red_i[warp] = v;
    __syncthreads();
    v = S.red_i[lane];
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

static __device__ float blk_max_f(float v, k_smem &S) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    __syncthreads();
    if (lane == 0) S.red_f[warp] = v;
    __syncthreads();
    v = S.red_f[lane];
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// Argmax with the lowest index on ties.
static __device__ int blk_argmax(float v, int i, k_smem &S) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(FULL, v, o);
        int oi = __shfl_xor_sync(FULL, i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    __syncthreads();
    if (lane == 0) S.red_f[warp] = v, S.red_i[warp] = i;
    __syncthreads();
    v = S.red_f[lane], i = S.red_i[lane];
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(FULL, v, o);
        int oi = __shfl_xor_sync(FULL, i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    return i;
}

// Online softmax statistics: (max, sum of exp(x - max)) over the block.
static __device__ void blk_lse(float m, double s, k_smem &S, float *m_out, double *s_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int pass = 0; pass < 2; pass++) {
        for (int o = 16; o; o >>= 1) {
            float om = __shfl_xor_sync(FULL, m, o);
            double os = __shfl_xor_sync(FULL, s, o);
            float nm = fmaxf(m, om);
            double a = m == -INFINITY ? 0.0 : s * exp((double)m - (double)nm);
            double b = om == -INFINITY ? 0.0 : os * exp((double)om - (double)nm);
            m = nm, s = a + b;
        }
        if (pass) break;
        __syncthreads();
        if (lane == 0) S.red_f[warp] = m, S.red_d[warp] = s;
        __syncthreads();
        m = S.red_f[lane], s = S.red_d[lane];
    }
    *m_out = m, *s_out = s;
}

// Exclusive prefix sum of v over the threads in order; *total: the block's sum.
static __device__ int blk_excl_scan_i(int v, k_smem &S, int *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += t;
    }
    __syncthreads();
    if (lane == 31) S.scan_i[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = S.scan_i[lane], y = w;
        for (int o = 1; o < 32; o <<= 1) {
            int t = __shfl_up_sync(FULL, y, o);
            if (lane >= o) y += t;
        }
        S.scan_i[lane] = y - w;
        if (lane == 31) S.red_i[0] = y;
    }
    __syncthreads();
    *total = S.red_i[0];
    return S.scan_i[warp] + x - v;
}

static __device__ double blk_excl_scan_d(double v, k_smem &S, double *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double x = v;
    for (int o = 1; o < 32; o <<= 1) {
        double t = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += t;
    }
    double ex = __shfl_up_sync(FULL, x, 1);
    if (lane == 0) ex = 0;
    __syncthreads();
    if (lane == 31) S.scan_d[warp] = x;
    __syncthreads();
    if (warp == 0) {
        double w = S.scan_d[lane], y = w;
        for (int o = 1; o < 32; o <<= 1) {
            double t = __shfl_up_sync(FULL, y, o);
            if (lane >= o) y += t;
        }
        double ey = __shfl_up_sync(FULL, y, 1);
        S.scan_d[lane] = lane ? ey : 0.0;
        if (lane == 31) S.red_d[0] = y;
    }
    __syncthreads();
    *total = S.red_d[0];
    return S.scan_d[warp] + ex;
}

// ---- radix select ------------------------------------------------------------------------------

// Over the elements f accepts (f(i, &key, &w) -> bool, weight w >= 0), finds the key K with
// W(key > K) < want <= W(key >= K), W the summed weight; when rounding leaves want above the
// total, the smallest key with weight. *above = W(key > K), *eq = W(key == K).
template <class F>
static __device__ uint32_t radix_select(int V, double want, F f, k_smem &S, double *above_out, double *eq_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t prefix = 0, mask = 0;
    double above = 0, eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < NHIST * RADIX; j += NT) (&S.hist[0][0])[j] = 0.0;
        __syncthreads();
        double *h = S.hist[warp >> 1];
        for (int i = threadIdx.x; i < V; i += NT) {
            uint32_t key;
            double w;
            if (f(i, &key, &w) && w > 0 && (key & mask) == prefix) atomicAdd(&h[(key >> shift) & 255u], w);
        }
        __syncthreads();
        if (threadIdx.x < RADIX) {
            double t = 0;
            for (int c = 0; c < NHIST; c++) t += S.hist[c][threadIdx.x];
            S.tot[threadIdx.x] = t;
        }
        __syncthreads();
        if (warp == 0) {
            // Lane L holds digits 255 - 8L - j (j = 0..7): lanes in descending digit order.
            double w8[8], chunk = 0;
            for (int j = 0; j < 8; j++) chunk += (w8[j] = S.tot[255 - 8 * lane - j]);
            double incl = chunk;
            for (int o = 1; o < 32; o <<= 1) {
                double t = __shfl_up_sync(FULL, incl, o);
                if (lane >= o) incl += t;
            }
            double excl = __shfl_up_sync(FULL, incl, 1);
            if (lane == 0) excl = 0;
            unsigned hit = __ballot_sync(FULL, chunk > 0 && above + incl >= want);
            unsigned nz = __ballot_sync(FULL, chunk > 0);
            int L = hit ? __ffs(hit) - 1 : (nz ? 31 - __clz(nz) : -1);
            if (lane == L) {
                double acc = above + excl, acc_last = acc;
                int pick = -1, last = -1;
                for (int j = 0; j < 8; j++) {
                    if (w8[j] > 0) {
                        last = j, acc_last = acc;
                        if (hit && acc + w8[j] >= want) {
                            pick = j;
                            break;
                        }
                        acc += w8[j];
                    }
                }
                if (pick < 0) pick = last;
                S.sel_digit = 255 - 8 * lane - pick, S.sel_above = acc_last, S.sel_eq = w8[pick];
            }
            if (L < 0 && lane == 0) S.sel_digit = 0, S.sel_above = above, S.sel_eq = 0;
        }
        __syncthreads();
        prefix |= (uint32_t)S.sel_digit << shift;
        mask |= 255u << shift;
        above = S.sel_above, eq = S.sel_eq;
    }
    *above_out = above, *eq_out = eq;
    return prefix;
}

// ---- the kernel --------------------------------------------------------------------------------

// Raw logprob statistics of row x: the log-sum-exp and, when n > 0, the top n (value desc, id asc)
// into S.top_ids / S.top_vals (S.n_top of them).
static __device__ float raw_logprobs(const float *x, int V, int n, k_smem &S) {
    float m = -INFINITY;
    double s = 0;
    for (int i = threadIdx.x; i < V; i += NT) {
        float v = x[i];
        if (v > m) s = (m == -INFINITY ? 0.0 : s * exp((double)m - (double)v)) + 1.0, m = v;
        else if (v > -INFINITY) s += exp((double)__fsub_rn(v, m));
    }
    blk_lse(m, s, S, &m, &s);
    float lse = __fadd_rn(m, (float)log(s));
    if (threadIdx.x == 0) S.n_top = 0;
    n = min(n, V);
    if (n <= 0) return lse;
    double above, eq;
    uint32_t K = radix_select(V, (double)n, [&](int i, uint32_t *k, double *w) { *k = fkey(x[i]); *w = 1.0; return true; },
                              S, &above, &eq);
    int need_ties = n - (int)above, tie_carry = 0, tot;
    for (int base = 0; base < V; base += TILE) {
        int i0 = base + threadIdx.x * ITEMS, n_eq = 0;
        for (int j = 0; j < ITEMS; j++) n_eq += i0 + j < V && fkey(x[i0 + j]) == K;
        int rank = blk_excl_scan_i(n_eq, S, &tot) + tie_carry;
        for (int j = 0; j < ITEMS; j++) {
            int i = i0 + j;
            if (i >= V) break;
            uint32_t k = fkey(x[i]);
            bool take = k > K || (k == K && rank++ < need_ties);
            if (take) {
                int slot = atomicAdd(&S.n_top, 1);
                if (slot < PD_SAMPLE_KMAX_TOP) S.top_ids[slot] = i, S.top_vals[slot] = x[i];
            }
        }
        tie_carry += tot;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // n <= 20: insertion sort by (value desc, id asc)
        int c = min(S.n_top, PD_SAMPLE_KMAX_TOP);
        for (int a = 1; a < c; a++)
            for (int b = a; b > 0; b--) {
                float vb = S.top_vals[b], va = S.top_vals[b - 1];
                int ib = S.top_ids[b], ia = S.top_ids[b - 1];
                if (!(vb > va || (vb == va && ib < ia))) break;
                S.top_vals[b] = va, S.top_vals[b - 1] = vb, S.top_ids[b] = ia, S.top_ids[b - 1] = ib;
            }
        S.n_top = c;
    }
    __syncthreads();
    return lse;
}

// Applies (undo = false) or removes (undo = true) the row's penalties in place.
static __device__ void penalties(float *x, const pd_sample_krow &R, const pd_sample_kpen *pens, float *pen_raw,
                                 bool undo) {
    bool rep = R.repetition != 1.0f, pf = R.presence != 0.0f || R.frequency != 0.0f;
    for (int e = threadIdx.x; e < R.n_pens; e += NT) {
        pd_sample_kpen P = pens[R.pen_begin + e];
        if (undo) {
            x[P.token] = pen_raw[R.pen_begin + e];
            continue;
        }
        float v = x[P.token];
        pen_raw[R.pen_begin + e] = v;
        if (rep && P.is_seen) v = v > 0 ? __fdiv_rn(v, R.repetition) : __fmul_rn(v, R.repetition);
        if (pf && P.count > 0) v = __fsub_rn(v, __fadd_rn(R.presence, __fmul_rn(R.frequency, (float)P.count)));
        if (P.bias != 0.0f) v = P.bias <= -100.0f ? -INFINITY : __fadd_rn(v, P.bias);
        x[P.token] = v;
    }
    __syncthreads();
}

// The logit of token i as sampling sees it: -inf when the row's mask M disallows it.
static __device__ __forceinline__ float lg(const float *x, const uint32_t *M, int i) {
    return M && !((M[i >> 5] >> (i & 31)) & 1u) ? -INFINITY : x[i];
}

// The surviving set: key > Kc, the first jc tokens (by id) with key == Kc, and l >= thresh.
struct cut_t {
    uint32_t Kc;
    int jc;        // INT_MAX: every tie
    float thresh;  // -INFINITY: no min-p
};

// Top-k, then top-p (over the top-k set). mx: max of l.
static __device__ cut_t truncate(const float *x, const uint32_t *M, int V, const pd_sample_krow &R, float mx,
                                 k_smem &S) {
    float it = R.inv_temp;
    cut_t c = {0u, INT_MAX, -INFINITY};
    uint32_t Kk = 0;
    double frac = 1.0;  // share of the ties at Kk inside the top-k set
    int n_tie_k = 0;
    if (R.top_k > 0) {
        double above, eq;
        Kk = radix_select(V, (double)R.top_k,
                          [&](int i, uint32_t *k, double *w) { *k = fkey(__fmul_rn(lg(x, M, i), it)); *w = 1.0; return true; },
                          S, &above, &eq);
        n_tie_k = R.top_k - (int)above;
        frac = (double)n_tie_k / eq;
        c.Kc = Kk, c.jc = n_tie_k;
    }
    if (R.top_p < 1.0f) {
        double tot = 0;
        for (int i = threadIdx.x; i < V; i += NT) {
            float l = __fmul_rn(lg(x, M, i), it);
            uint32_t k = fkey(l);
            if (k >= Kk) tot += (double)elem_e(l, mx) * (k == Kk && R.top_k > 0 ? frac : 1.0);
        }
        tot = blk_sum_d(tot, S);
        double want = (double)R.top_p * tot, above, eq;
        bool has_k = R.top_k > 0;
        uint32_t Kp = radix_select(V, want,
                                   [&](int i, uint32_t *k, double *w) {
                                       float l = __fmul_rn(lg(x, M, i), it);
                                       *k = fkey(l);
                                       if (has_k && *k < Kk) return false;
                                       *w = (double)elem_e(l, mx) * (has_k && *k == Kk ? frac : 1.0);
                                       return true;
                                   },
                                   S, &above, &eq);
        double e1 = (double)elem_e(fval(Kp), mx);
        int avail = e1 > 0 ? (int)llrint(eq / e1) : 0, j = avail;  // ties at Kp inside the candidate set
        if (e1 > 0 && want > above) {
            double need = ceil((want - above) / e1);
            j = need < (double)avail ? (int)need : avail;
        }
        if (j < 1) j = 1;
        c.Kc = Kp, c.jc = j;  // draw() treats jc >= the number of ties as "all of them"
    }
    if (R.log_min_p > -INFINITY) c.thresh = __fadd_rn(mx, R.log_min_p);
    return c;
}

// Draws from the surviving set: the first token (id order) whose running mass exceeds u * S.
static __device__ int draw(const float *x, const uint32_t *M, int V, const pd_sample_krow &R, float mx, cut_t c,
                           k_smem &S) {
    float it = R.inv_temp;
    // S: surviving mass = mass(key > Kc, l >= thresh) + the kept ties' mass.
    double m = 0;
    int n_eq = 0;
    for (int i = threadIdx.x; i < V; i += NT) {
        float l = __fmul_rn(lg(x, M, i), it);
        uint32_t k = fkey(l);
        if (k > c.Kc && l >= c.thresh) m += (double)elem_e(l, mx);
        n_eq += k == c.Kc;
    }
    m = blk_sum_d(m, S);
    n_eq = blk_sum_i(n_eq, S);
    float lc = fval(c.Kc);
    if (n_eq > 0 && lc >= c.thresh) m += (double)min(n_eq, c.jc) * (double)elem_e(lc, mx);
    double r = pd_sample_uniform_of(R.seed, R.draw_idx) * m, carry = 0, tot;
    bool partial = c.jc < n_eq;
    int tie_carry = 0, ttot;
    if (threadIdx.x == 0) S.token = INT_MAX, S.last_keep = -1;
    __syncthreads();
    for (int base = 0; base < V; base += TILE) {
        int i0 = base + threadIdx.x * ITEMS, rank = 0;
        float l[ITEMS];
        uint32_t k[ITEMS];
        for (int j = 0; j < ITEMS; j++) {
            l[j] = i0 + j < V ? __fmul_rn(lg(x, M, i0 + j), it) : -INFINITY;
            k[j] = fkey(l[j]);
        }
        if (partial) {
            int n = 0;
            for (int j = 0; j < ITEMS; j++) n += i0 + j < V && k[j] == c.Kc;
            rank = blk_excl_scan_i(n, S, &ttot) + tie_carry;
            tie_carry += ttot;
        }
        double w[ITEMS], tw = 0;
        int last = -1;
        for (int j = 0; j < ITEMS; j++) {
            bool keep = i0 + j < V && (k[j] > c.Kc || (k[j] == c.Kc && rank++ < c.jc)) && l[j] >= c.thresh;
            w[j] = keep ? (double)elem_e(l[j], mx) : 0.0;
            tw += w[j];
            if (keep) last = i0 + j;
        }
        double acc = blk_excl_scan_d(tw, S, &tot) + carry;
        for (int j = 0; j < ITEMS; j++) {
            double prev = acc;
            acc += w[j];
            if (w[j] > 0 && r < acc && r >= prev) atomicMin(&S.token, i0 + j);
        }
        if (last >= 0) atomicMax(&S.last_keep, last);
        __syncthreads();
        if (S.token != INT_MAX) break;
        carry += tot;
    }
    int t = S.token != INT_MAX ? S.token : S.last_keep;
    return t < 0 ? 0 : t;
}

static __global__ void __launch_bounds__(NT) k_sample(pd_sample_kparams p) {
    __shared__ k_smem S;
    int row = blockIdx.x, V = p.vocab;
    const pd_sample_krow R = p.rows[row];
    float *x = p.logits + (size_t)row * (size_t)V;
    const uint32_t *M = R.mask_row >= 0 ? p.masks + (size_t)R.mask_row * (size_t)p.mask_words : nullptr;
    float lse = 0;
    if (R.n_logprobs >= 0) lse = raw_logprobs(x, V, R.n_logprobs, S);
    if (R.n_pens > 0) penalties(x, R, p.pens, p.pen_raw, false);
    int token;
    if (R.is_greedy) {
        float bv = -INFINITY;
        int bi = 0;
        for (int i = threadIdx.x; i < V; i += NT) {
            float v = lg(x, M, i);
            if (v > bv) bv = v, bi = i;  // ascending i: the first maximum of this thread
        }
        token = blk_argmax(bv, bi, S);
    } else {
        float mx = -INFINITY;
        for (int i = threadIdx.x; i < V; i += NT) mx = fmaxf(mx, __fmul_rn(lg(x, M, i), R.inv_temp));
        mx = blk_max_f(mx, S);
        cut_t c = truncate(x, M, V, R, mx, S);
        token = draw(x, M, V, R, mx, c, S);
    }
    if (R.n_pens > 0) penalties(x, R, p.pens, p.pen_raw, true);
    if (threadIdx.x == 0) {
        pd_sample_kout *o = &p.out[row];
        o->token = token;
        o->logprob = R.n_logprobs >= 0 ? __fsub_rn(x[token], lse) : 0.0f;
        o->n_top = R.n_logprobs > 0 ? S.n_top : 0;
        for (int j = 0; j < o->n_top; j++) o->top_ids[j] = S.top_ids[j], o->top_logprobs[j] = __fsub_rn(S.top_vals[j], lse);
    }
}

extern "C" void pd_cuda_sample(const pd_sample_kparams *p, cudaStream_t s) {
    if (p->n_rows <= 0) return;
    k_sample<<<p->n_rows, NT, 0, s>>>(*p);
}
