// sample.cu — one token per row of f32 logits, on the device, with the CPU sampler's semantics
// (src/model/sample.c): penalties → temperature → top-k → top-p → min-p → draw; logprobs of the
// raw logits; greedy ties to the lowest id.
//
// A row is sampled by a thread-block cluster of CL CTAs of 1024 threads (CL = 1, 2, 4, 8 or 16,
// chosen per launch: the largest whose clusters for every row can be resident at once, so on an
// H100 one sequence gets 16 SMs, 64 rows get 2, 256 rows one CTA each; greedy-only launches of
// more than 8 rows keep one CTA a row). CTA `rank` of the cluster owns the contiguous id range
// [rank * V / CL, (rank + 1) * V / CL) of the row, so the id order of the row is (rank, then id
// inside the chunk). Every pass reads only the CTA's own chunk (re-read from L2 rather than
// sorted); every reduction is a block reduction followed by an exchange through distributed
// shared memory (each CTA publishes its partial value, every CTA reads all CL partials and
// combines them in rank order, so all CTAs of a row compute the same value and take the same
// decisions). Passes, each skipped when the row does not need it:
//
//   A  raw log-sum-exp (online max + sum)          logprobs
//      radix select of the N-th largest raw logit  top-N logprobs, then an ordered gather
//   B  penalties and logit bias in place (sparse entries; each CTA applies those of its chunk; the
//      overwritten values are saved in pen_raw). A row with a token mask reads every disallowed
//      token as -inf in C (lg()), so the mask is never written into the logits.
//   C  greedy: argmax.  Random: max of l = x * (1/T), then
//      top-k: radix select of the k-th largest l (counts)
//      top-p: radix select by probability mass (restricted to the top-k set)
//      min-p: a value threshold, mx + log(min_p)
//      S: the surviving mass (per chunk, then an exclusive scan over the cluster); draw: u * S
//      located in the one chunk whose mass range holds it, by a block-wide inclusive scan in id
//      order
//   D  penalties undone (pen_raw), the token's raw logprob
//
// Every truncation keeps a prefix of the order (value desc, id asc), so the survivors are "key >
// Kc, plus the first jc tokens (by id) whose key equals Kc" (tie ranks: an exclusive scan of the
// per-chunk tie counts over the cluster, then over the threads). The radix select works on the
// 32-bit order-preserving key of the float, 8 bits a pass (4 passes), with per-warp-pair
// shared-memory histograms (double weights: counts, or exp masses), so that the clustered high
// digits of real logits do not serialise on one address; the CL histograms of a row are summed in
// rank order. Element arithmetic matches the CPU bit for bit where it can (no FMA contraction:
// __fmul_rn / __fadd_rn; exp computed in double and rounded to float like glibc's expf; 1/T and
// logf(min_p) come from the host), so seeded draws agree except when u*S lands within rounding of
// a boundary (the sums are in double in another order than the CPU's).
//
// Launches with a top-k or top-p row run the FAST instance, which truncates those rows by the
// candidate-set path (see "the candidate-set path" below: one histogram pass relative to the max,
// <= 1024 candidates compacted and ranked exactly, no radix passes), falling back to the passes
// above when the candidates overflow; other launches (greedy, temperature, min-p) run the plain
// instance, the previous kernel's code. Small batches (<= PD_SAMPLE_KINLINE rows without penalties
// or masks) take their rows from the launch's parameters (k_sample_inl), and the shim has the
// results written straight into mapped pinned memory: no copy either way.
//
// Top-p rows without top-k whose chunk fits shared memory twice (clusters of 8-16 CTAs) take the
// one-read path instead (topp_row: the chunk read once, one id-ordered scan for the draw). The
// boundary bin comes from the cluster's histograms in two levels (boundary(): super-bins, then the
// bins of one super-bin), not every CTA reading every bin of every other CTA.
//
// PD_CUDA_SAMPLE_CLUSTER=1|2|4|8|16 forces the cluster size (1: one CTA per row, the previous
// kernel's layout). PD_CUDA_SAMPLE_FAST=0: the radix passes only. PD_CUDA_SAMPLE_TOPP_MIN_CL=N:
// top-p rows without top-k take the candidate-set path only from clusters of N CTAs (default 1:
// always; 32: never). PD_CUDA_SAMPLE_TOPP2=0: no one-read path. PD_CUDA_SAMPLE_GATHER=0: the full
// gather (session 8). Measured: docs/benchmarks.md, "Sampler: top-p alone at batch 1".
#include <cooperative_groups.h>
#include <math.h>
#include <string.h>

#include "kernels/common.cuh"
#include "kernels/sample.cuh"
#include "kernels/sample_rng.h"

namespace cg = cooperative_groups;

// Phase timing, compiled only into tools/gpu/sample_prof.cu (PD_SAMPLE_PROF): thread 0 of the
// launch's first CTA adds the SM clocks since its previous mark to slot k (reset by the harness).
#ifdef PD_SAMPLE_PROF
__device__ long long g_sprof[32];
__shared__ long long s_sprof[32], s_sprof_last;  // (kept in shared memory: a mark costs no global round trip)
#define SPROF_ON (blockIdx.x == 0 && threadIdx.x == 0)
#define SPROF_START() \
    do { \
        if (SPROF_ON) { \
            for (int k_ = 0; k_ < 32; k_++) s_sprof[k_] = 0; \
            s_sprof_last = clock64(); \
        } \
    } while (0)
#define SPROF(k) \
    do { \
        if (SPROF_ON) { \
            long long now_ = clock64(); \
            s_sprof[k] += now_ - s_sprof_last; \
            s_sprof_last = now_; \
        } \
    } while (0)
#define SPROF_FLUSH() \
    do { \
        if (SPROF_ON) \
            for (int k_ = 0; k_ < 32; k_++) g_sprof[k_] += s_sprof[k_]; \
    } while (0)
#else
#define SPROF_START() do { } while (0)
#define SPROF(k) do { } while (0)
#define SPROF_FLUSH() do { } while (0)
#endif

#define NT 1024
#define NWARP (NT / 32)
#define RADIX 256
#define NHIST 16            // histogram copies: warps 2c and 2c+1 share copy c
#define ITEMS 4             // consecutive elements per thread in the ordered (id-order) passes
#define TILE (NT * ITEMS)
#define FULL 0xffffffffu
#define CLMAX 16

struct k_smem {
    double hist[NHIST][RADIX];
    double tot[2][RADIX];    // this CTA's digit totals (read by the cluster), by pass parity
    double gtot[RADIX];      // the row's digit totals (rank order)
    double red_d[NWARP];
    float red_f[NWARP];
    int red_i[NWARP];
    double scan_d[NWARP];
    int scan_i[NWARP];
    double pub_d;            // this CTA's partial, published for the cluster
    float pub_f;
    int pub_i[2];
    double gat_d[CLMAX];     // every CTA's partial, by rank
    float gat_f[CLMAX];
    int gat_i[2][CLMAX];
    int sel_digit;
    double sel_above, sel_eq;
    int token, last_keep, n_top;
    int top_ids[PD_SAMPLE_KMAX_TOP];
    float top_vals[PD_SAMPLE_KMAX_TOP];
};

// The CTA's share of its row.
struct chunk_t {
    int beg, end, rank;
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

// ---- cluster exchange ---------------------------------------------------------------------------

// Every thread calls. Thread 0 has set S.pub_*; afterwards S.gat_*[r] holds rank r's values, for
// every thread. The second barrier keeps a CTA from overwriting pub_* (or exiting) while another
// still reads it.
template <int CL> static __device__ __forceinline__ void xchg(k_smem &S) {
    if constexpr (CL == 1) {
        __syncthreads();
        if (threadIdx.x == 0) S.gat_d[0] = S.pub_d, S.gat_f[0] = S.pub_f, S.gat_i[0][0] = S.pub_i[0], S.gat_i[1][0] = S.pub_i[1];
        __syncthreads();
    } else {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (threadIdx.x < CL) {
            const k_smem *R = cl.map_shared_rank(&S, threadIdx.x);
            S.gat_d[threadIdx.x] = R->pub_d, S.gat_f[threadIdx.x] = R->pub_f;
            S.gat_i[0][threadIdx.x] = R->pub_i[0], S.gat_i[1][threadIdx.x] = R->pub_i[1];
        }
        cl.sync();
    }
}

template <int CL> static __device__ double clu_sum_d(double v, k_smem &S) {
    v = blk_sum_d(v, S);
    if (threadIdx.x == 0) S.pub_d = v;
    xchg<CL>(S);
    double t = 0;
    for (int r = 0; r < CL; r++) t += S.gat_d[r];
    return t;
}

// Exclusive scan over the cluster of one value per CTA (v: the same in every thread of the CTA).
template <int CL> static __device__ double clu_scan_d(double v, int rank, k_smem &S, double *total) {
    if (threadIdx.x == 0) S.pub_d = v;
    xchg<CL>(S);
    double t = 0, before = 0;
    for (int r = 0; r < CL; r++) {
        if (r == rank) before = t;
        t += S.gat_d[r];
    }
    *total = t;
    return before;
}

template <int CL> static __device__ int clu_scan_i(int v, int rank, k_smem &S, int *total) {
    if (threadIdx.x == 0) S.pub_i[0] = v;
    xchg<CL>(S);
    int t = 0, before = 0;
    for (int r = 0; r < CL; r++) {
        if (r == rank) before = t;
        t += S.gat_i[0][r];
    }
    *total = t;
    return before;
}

template <int CL> static __device__ float clu_max_f(float v, k_smem &S) {
    v = blk_max_f(v, S);
    if (threadIdx.x == 0) S.pub_f = v;
    xchg<CL>(S);
    float m = -INFINITY;
    for (int r = 0; r < CL; r++) m = fmaxf(m, S.gat_f[r]);
    return m;
}

// Argmax with the lowest index on ties; (v, i): this thread's best.
template <int CL> static __device__ int clu_argmax(float v, int i, k_smem &S) {
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
    if (threadIdx.x == 0) S.pub_f = v, S.pub_i[0] = i;
    xchg<CL>(S);
    float bv = S.gat_f[0];
    int bi = S.gat_i[0][0];
    for (int r = 1; r < CL; r++) {
        float ov = S.gat_f[r];
        int oi = S.gat_i[0][r];
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    return bi;
}

// Online softmax statistics (max, sum of exp(x - max)) over the row.
template <int CL> static __device__ void clu_lse(float m, double s, k_smem &S, float *m_out, double *s_out) {
    blk_lse(m, s, S, &m, &s);
    if (threadIdx.x == 0) S.pub_f = m, S.pub_d = s;
    xchg<CL>(S);
    m = S.gat_f[0], s = S.gat_d[0];
    for (int r = 1; r < CL; r++) {
        float om = S.gat_f[r];
        double os = S.gat_d[r];
        float nm = fmaxf(m, om);
        double a = m == -INFINITY ? 0.0 : s * exp((double)m - (double)nm);
        double b = om == -INFINITY ? 0.0 : os * exp((double)om - (double)nm);
        m = nm, s = a + b;
    }
    *m_out = m, *s_out = s;
}

// ---- radix select ------------------------------------------------------------------------------

// Over the elements of the row f accepts (f(i, &key, &w) -> bool, weight w >= 0), finds the key K
// with W(key > K) < want <= W(key >= K), W the summed weight; when rounding leaves want above the
// total, the smallest key with weight. *above = W(key > K), *eq = W(key == K). Each CTA histograms
// its chunk; the cluster's histograms are summed in rank order, so every CTA selects the same K.
// UNIT: every accepted element weighs 1 (counts).
template <int CL, bool UNIT, class F>
static __device__ uint32_t radix_select(chunk_t C, double want, F f, k_smem &S, double *above_out, double *eq_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t prefix = 0, mask = 0;
    double above = 0, eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < NHIST * RADIX; j += NT) (&S.hist[0][0])[j] = 0.0;
        __syncthreads();
        double *h = S.hist[warp >> 1];
        if constexpr (UNIT) {
            // Counts, warp-aggregated: the lanes of a warp with the same digit add once (real logits
            // cluster in a few high digits, and same-address double atomics in shared memory
            // serialise). Masses are added one by one: summing a group through shuffles measured
            // slower than the contended atomics (op_bench sample, top-p at batch 64 / 256).
            for (int i0 = C.beg + (threadIdx.x & ~31); i0 < C.end; i0 += NT) {  // warp-uniform trip count
                int i = i0 + lane;
                uint32_t key = 0;
                double w = 0;
                bool ok = i < C.end && f(i, &key, &w) && w > 0 && (key & mask) == prefix;
                unsigned okm = __ballot_sync(FULL, ok);
                if (ok) {
                    int dig = (int)((key >> shift) & 255u);
                    unsigned grp = __match_any_sync(okm, dig);
                    if (lane == __ffs(grp) - 1) atomicAdd(&h[dig], (double)__popc(grp));
                }
            }
        } else {
            for (int i = C.beg + threadIdx.x; i < C.end; i += NT) {
                uint32_t key;
                double w;
                if (f(i, &key, &w) && w > 0 && (key & mask) == prefix) atomicAdd(&h[(key >> shift) & 255u], w);
            }
        }
        __syncthreads();
        int par = (shift >> 3) & 1;  // tot alternates between passes (every select starts at 1, ends at 0)
        if (threadIdx.x < RADIX) {
            double t = 0;
            for (int c = 0; c < NHIST; c++) t += S.hist[c][threadIdx.x];
            S.tot[par][threadIdx.x] = t;
            if constexpr (CL == 1) S.gtot[threadIdx.x] = t;
        }
        if constexpr (CL > 1) {
            // One cluster barrier a pass: a CTA rewrites tot[par] two passes later, after the next
            // pass's barrier, which every CTA reaches only once it has read this pass's tot[par].
            cg::cluster_group cl = cg::this_cluster();
            cl.sync();
            if (threadIdx.x < RADIX) {
                double t = 0;
                for (int r = 0; r < CL; r++) t += cl.map_shared_rank(&S, r)->tot[par][threadIdx.x];
                S.gtot[threadIdx.x] = t;
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane L holds digits 255 - 8L - j (j = 0..7): lanes in descending digit order.
            double w8[8], chunk = 0;
            for (int j = 0; j < 8; j++) chunk += (w8[j] = S.gtot[255 - 8 * lane - j]);
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
// into S.top_ids / S.top_vals (S.n_top of them) of the cluster's rank 0 (the other ranks hold
// their chunk's share only).
template <int CL> static __device__ float raw_logprobs(const float *x, chunk_t C, int V, int n, k_smem &S) {
    float m = -INFINITY;
    double s = 0;
    for (int i = C.beg + threadIdx.x; i < C.end; i += NT) {
        float v = x[i];
        if (v > m) s = (m == -INFINITY ? 0.0 : s * exp((double)m - (double)v)) + 1.0, m = v;
        else if (v > -INFINITY) s += exp((double)__fsub_rn(v, m));
    }
    clu_lse<CL>(m, s, S, &m, &s);
    float lse = __fadd_rn(m, (float)log(s));
    if (threadIdx.x == 0) S.n_top = 0;
    n = min(n, V);
    if (n <= 0) return lse;
    double above, eq;
    uint32_t K = radix_select<CL, true>(C, (double)n, [&](int i, uint32_t *k, double *w) { *k = fkey(x[i]); *w = 1.0; return true; },
                                  S, &above, &eq);
    int need_ties = n - (int)above, tot, n_eq = 0, all_eq;
    for (int i = C.beg + threadIdx.x; i < C.end; i += NT) n_eq += fkey(x[i]) == K;
    int tie_carry = clu_scan_i<CL>(blk_sum_i(n_eq, S), C.rank, S, &all_eq);
    for (int base = C.beg; base < C.end; base += TILE) {
        int i0 = base + threadIdx.x * ITEMS, ne = 0;
        for (int j = 0; j < ITEMS; j++) ne += i0 + j < C.end && fkey(x[i0 + j]) == K;
        int rank = blk_excl_scan_i(ne, S, &tot) + tie_carry;
        for (int j = 0; j < ITEMS; j++) {
            int i = i0 + j;
            if (i >= C.end) break;
            uint32_t k = fkey(x[i]);
            bool take = k > K || (k == K && rank++ < need_ties);
            if (take) {
                int slot = atomicAdd(&S.n_top, 1);
                if (slot < PD_SAMPLE_KMAX_TOP) S.top_ids[slot] = i, S.top_vals[slot] = x[i];
            }
        }
        tie_carry += tot;
    }
    if constexpr (CL > 1) {  // rank 0 collects the other chunks' picks
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (C.rank == 0 && threadIdx.x == 0) {
            int c = min(S.n_top, PD_SAMPLE_KMAX_TOP);
            for (int r = 1; r < CL; r++) {
                const k_smem *R = cl.map_shared_rank(&S, r);
                int nr = min(R->n_top, PD_SAMPLE_KMAX_TOP);
                for (int j = 0; j < nr && c < PD_SAMPLE_KMAX_TOP; j++, c++) S.top_ids[c] = R->top_ids[j], S.top_vals[c] = R->top_vals[j];
            }
            S.n_top = c;
        }
        cl.sync();  // the other ranks keep their lists until rank 0 has read them
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

// Applies (undo = false) or removes (undo = true) the row's penalties in place, for the tokens of
// this CTA's chunk.
static __device__ void penalties(float *x, chunk_t C, const pd_sample_krow &R, const pd_sample_kpen *pens, float *pen_raw,
                                 bool undo) {
    bool rep = R.repetition != 1.0f, pf = R.presence != 0.0f || R.frequency != 0.0f;
    for (int e = threadIdx.x; e < R.n_pens; e += NT) {
        pd_sample_kpen P = pens[R.pen_begin + e];
        if (P.token < C.beg || P.token >= C.end) continue;
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
template <int CL>
static __device__ cut_t truncate(const float *x, const uint32_t *M, chunk_t C, const pd_sample_krow &R, float mx, k_smem &S) {
    float it = R.inv_temp;
    cut_t c = {0u, INT_MAX, -INFINITY};
    uint32_t Kk = 0;
    double frac = 1.0;  // share of the ties at Kk inside the top-k set
    int n_tie_k = 0;
    if (R.top_k > 0) {
        double above, eq;
        Kk = radix_select<CL, true>(C, (double)R.top_k,
                              [&](int i, uint32_t *k, double *w) { *k = fkey(__fmul_rn(lg(x, M, i), it)); *w = 1.0; return true; },
                              S, &above, &eq);
        n_tie_k = R.top_k - (int)above;
        frac = (double)n_tie_k / eq;
        c.Kc = Kk, c.jc = n_tie_k;
    }
    if (R.top_p < 1.0f) {
        double tot = 0;
        for (int i = C.beg + threadIdx.x; i < C.end; i += NT) {
            float l = __fmul_rn(lg(x, M, i), it);
            uint32_t k = fkey(l);
            if (k >= Kk) tot += (double)elem_e(l, mx) * (k == Kk && R.top_k > 0 ? frac : 1.0);
        }
        tot = clu_sum_d<CL>(tot, S);
        double want = (double)R.top_p * tot, above, eq;
        bool has_k = R.top_k > 0;
        uint32_t Kp = radix_select<CL, false>(C, want,
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

// One id-ordered pass over the chunk: the surviving weights, tile by tile (ties at Kc ranked from
// tie_base). Returns the chunk's surviving mass and sets S.last_keep (the largest surviving id seen,
// -1: none); FIND: also the first token whose running mass (from carry0) exceeds r, into S.token
// (INT_MAX: none), stopping there.
// CACHED: the weights come from E (this chunk's exp(l - mx), cached by the candidate-set pass).
template <bool FIND, bool CACHED>
static __device__ double survivors(const float *x, const uint32_t *M, chunk_t C, float it, float mx, cut_t c,
                                   bool partial, int tie_base, double carry0, double r, k_smem &S, const float *E) {
    double carry = carry0, tot;
    int tie_carry = tie_base, ttot;
    if (threadIdx.x == 0) S.token = INT_MAX, S.last_keep = -1;
    __syncthreads();
    for (int base = C.beg; base < C.end; base += TILE) {
        int i0 = base + threadIdx.x * ITEMS, rank = 0;
        float l[ITEMS];
        uint32_t k[ITEMS];
        for (int j = 0; j < ITEMS; j++) {
            l[j] = i0 + j < C.end ? __fmul_rn(lg(x, M, i0 + j), it) : -INFINITY;
            k[j] = fkey(l[j]);
        }
        if (partial) {
            int n = 0;
            for (int j = 0; j < ITEMS; j++) n += i0 + j < C.end && k[j] == c.Kc;
            rank = blk_excl_scan_i(n, S, &ttot) + tie_carry;
            tie_carry += ttot;
        }
        double w[ITEMS], tw = 0;
        int last = -1;
        for (int j = 0; j < ITEMS; j++) {
            bool keep = i0 + j < C.end && (k[j] > c.Kc || (k[j] == c.Kc && rank++ < c.jc)) && l[j] >= c.thresh;
            w[j] = keep ? (double)(CACHED ? E[i0 + j - C.beg] : elem_e(l[j], mx)) : 0.0;
            tw += w[j];
            if (keep) last = i0 + j;
        }
        double acc = blk_excl_scan_d(tw, S, &tot) + carry;
        if (last >= 0) atomicMax(&S.last_keep, last);
        if (FIND) {
            for (int j = 0; j < ITEMS; j++) {
                double prev = acc;
                acc += w[j];
                if (w[j] > 0 && r < acc && r >= prev) atomicMin(&S.token, i0 + j);
            }
            __syncthreads();
            if (S.token != INT_MAX) break;
        }
        carry += tot;
    }
    __syncthreads();
    return carry - carry0;
}

// Draws from the surviving set: the first token (id order) whose running mass exceeds u * S.
template <int CL>
static __device__ int draw(const float *x, const uint32_t *M, chunk_t C, const pd_sample_krow &R, float mx, cut_t c,
                           k_smem &S) {
    float it = R.inv_temp;
    // this chunk's ties at Kc and its mass above Kc; the ties of the chunks before it, the row's
    int n_eq = 0;
    double m = 0;
    for (int i = C.beg + threadIdx.x; i < C.end; i += NT) {
        float l = __fmul_rn(lg(x, M, i), it);
        uint32_t k = fkey(l);
        if (k > c.Kc && l >= c.thresh) m += (double)elem_e(l, mx);
        n_eq += k == c.Kc;
    }
    m = blk_sum_d(m, S);
    n_eq = blk_sum_i(n_eq, S);
    int all_eq, tie_base = clu_scan_i<CL>(n_eq, C.rank, S, &all_eq);
    bool partial = c.jc < all_eq;
    // the chunk's surviving mass W (every tie kept: m plus the ties; else an ordered pass)
    double W;
    if (!partial) {
        float lc = fval(c.Kc);
        W = m + (n_eq > 0 && lc >= c.thresh ? (double)n_eq * (double)elem_e(lc, mx) : 0.0);
    } else {
        W = survivors<false, false>(x, M, C, it, mx, c, partial, tie_base, 0.0, 0.0, S, nullptr);
    }
    double total, before = clu_scan_d<CL>(W, C.rank, S, &total);
    int last_nz = -1;  // the last chunk with survivors: it answers when u * S rounds past the end
    for (int q = 0; q < CL; q++)
        if (S.gat_d[q] > 0) last_nz = q;
    double r = pd_sample_uniform_of(R.seed, R.draw_idx) * total;
    int token = INT_MAX;
    if (W > 0 && r >= before && (r < before + W || C.rank == last_nz)) {  // CTA-uniform
        survivors<true, false>(x, M, C, it, mx, c, partial, tie_base, before, r, S, nullptr);
        token = S.token != INT_MAX ? S.token : S.last_keep;
    }
    if (threadIdx.x == 0) S.pub_i[0] = token;
    xchg<CL>(S);
    int t = INT_MAX;
    for (int q = 0; q < CL; q++) t = min(t, S.gat_i[0][q]);
    return t == INT_MAX || t < 0 ? 0 : t;
}

// ---- the candidate-set path (top-k, top-p) -------------------------------------------------------
//
// One pass over the chunk histograms every element's bin, fbin(l) = (mx - l) * BSCALE truncated
// (1/64 of a logit a bin, bin 0 at the max; the last bin takes everything lower): counts, plus for
// top-p the weights exp(l - mx) (kept in the CTA's cache when the chunk fits), their exact sum in
// double, and approximate per-bin masses (float shared-memory atomics: the last, crowded bin gets
// none). The cluster's histograms are summed in rank order (one exchange). Since fbin is monotone
// in l, the k largest (value desc, id asc) lie in the bins up to the first whose running count
// reaches k, and the top-p cut lies in the bin whose running mass reaches top_p * total. Those
// candidates (top-k: every bin up to the boundary; top-p: the boundary bin) are compacted once, in
// id order, into every CTA's shared memory (at most CAND; more falls back to the radix passes),
// ranked exactly by (key desc, id asc), and cut there, so the truncation is the definition's. For
// top-p the mass above the bin is summed exactly (double) during the compaction, and a bin chosen
// wrongly by the approximate masses is detected (the cut must fall inside it) and sends the row to
// the radix passes too; every such decision is the same in every CTA of the row. Top-k then draws
// over the compacted set (one block scan, every CTA alike). Top-p draws over the row: each chunk's
// surviving mass is its mass above the bin plus its compacted survivors, and the one chunk holding
// u * S walks its elements in id order (survivors()) and hands the token to rank 0.
#define NB 1024          // histogram bins (== NT: one bin a thread in the scans)
#define BSCALE 64.0f     // bins a logit (range: 16 logits below the max)
#define CAND 1024        // candidate capacity (== NT: one candidate a thread)
#define ECACHE_MAX 24576 // largest chunk (floats) whose weights are cached: 96 KiB
#define NSB 32           // the two-level gather: NB / NSB super-bins of NSB bins (one a warp)
#define TOK_LATER (-2)   // fast_random: the token reaches rank 0's F.tok by the final cluster barrier

struct k_fast {          // dynamic shared memory, before the weight cache
    double bm[NB];       // this CTA's bin masses and counts, read by the cluster
    int bc[NB];
    uint32_t ck[CAND];   // the candidates in id order: key, id, weight
    int ci[CAND];
    float ce[CAND];
    float se[CAND];      // weights by rank; later the surviving weights in id order
    double wr[CLMAX];    // top-p: every chunk's surviving mass
    double ctot, abv, abvm;  // this CTA's total weight, weight above the bin (all / >= the min-p threshold)
    int first, last, key, n, off, tok;
    int rk[CAND];        // one-read top-p path: each candidate's rank, by position (id order)
    float pmx;           // one-read top-p path: this CTA's max, read by the cluster
    float rpmx[CLMAX];   // ... every CTA's, by rank
    double rabv[CLMAX];  // every CTA's weight above the bin, by rank
    // the two-level gather (boundary()): super-bins of NSB bins, published and gathered
    double sbm[NSB], gsm[NSB], gfm[NSB], rtot[CLMAX], sbm0;
    int sbc[NSB], gsc[NSB], gfc[NSB], rsc[CLMAX][NSB], rfc[CLMAX][NSB], sb, sbc0;
};

static __device__ __forceinline__ int fbin(float l, float mx) {
    float d = __fmul_rn(__fsub_rn(mx, l), BSCALE);
    return d < (float)(NB - 1) ? (int)d : NB - 1;  // -inf and NaN: the last bin
}

// Leaves the radix passes to decide the row (every CTA of the cluster returns here alike). The
// cluster barrier keeps each CTA's published values readable until every CTA is past them.
template <int CL> static __device__ int fast_give_up(void) {
    if constexpr (CL > 1) cg::this_cluster().sync();
    return -1;
}

// This CTA's histogram (2 copies by warp parity) into F.bm / F.bc, and its super-bins (warp w sums
// bins w * NSB .. w * NSB + NSB - 1, its own lanes' bins) into F.sbm / F.sbc.
static_assert(NB == NSB * NWARP, "a super-bin a warp");
static __device__ __forceinline__ void publish_bins(k_fast &F, const float *hm, const int *hc) {
    int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    double v = (double)hm[t] + (double)hm[NB + t];
    int c = hc[t] + hc[NB + t];
    F.bm[t] = v, F.bc[t] = c;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o), c += __shfl_xor_sync(FULL, c, o);
    if (lane == 0) F.sbm[warp] = v, F.sbc[warp] = c;
}

// The boundary bin of a row from its cluster's histograms. Every CTA has published its bin masses
// and counts (F.bm, F.bc), their sums over each run of NSB bins (F.sbm, F.sbc: super-bins) and its
// total weight F.ctot, and set F.first = INT_MAX; this makes them visible (the cluster barrier) and
// finds b: top-k (has_k), the first bin whose running count reaches k; top-p, the first bin whose
// approximate running mass reaches top_p * total, never the last (it holds everything 16 logits or
// more below the max and carries no mass). Sets F.first = b (INT_MAX: none),
// F.n (the candidates: top-k, every bin up to b; top-p, bin b) and F.off (those of the chunks
// before this CTA's); returns the row's total weight (rank order: the same in every CTA).
// two_level: each CTA reads the CL ranks' NSB super-bins, then the NSB bins of the super-bin that
// holds the cut (2 * NSB * CL remote values a CTA); otherwise every thread reads its bin of every
// rank (NB * CL remote values, ~28 us of a 16-CTA cluster on an H100: session 9, sample_prof).
// Every decision is the same in every CTA of the row.
template <int CL>
static __device__ double boundary(k_fast &F, k_smem &S, int rank, bool has_k, int top_k, float top_p, bool two_level) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (CL > 1 && two_level) {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        // coarse: warp s reads super-bin s of rank `lane`
        double v = 0;
        int c = 0;
        if (lane < CL) {
            const k_fast *Fr = cl.map_shared_rank(&F, lane);
            v = Fr->sbm[warp], c = Fr->sbc[warp];
            F.rsc[lane][warp] = c;
        }
        if (t < CL) F.rtot[t] = cl.map_shared_rank(&F, t)->ctot;
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o), c += __shfl_xor_sync(FULL, c, o);
        if (lane == 0) F.gsm[warp] = v, F.gsc[warp] = c;
        __syncthreads();
        double total = 0;
        for (int r = 0; r < CL; r++) total += F.rtot[r];
        const double want = (double)top_p * total;
        if (warp == 0) {  // lane s: super-bin s
            double m = F.gsm[lane], im = m;
            int cc = F.gsc[lane], ic = cc;
            for (int o = 1; o < 32; o <<= 1) {
                double tm = __shfl_up_sync(FULL, im, o);
                int tc = __shfl_up_sync(FULL, ic, o);
                if (lane >= o) im += tm, ic += tc;
            }
            double em = __shfl_up_sync(FULL, im, 1);
            int ec = __shfl_up_sync(FULL, ic, 1);
            if (lane == 0) em = 0, ec = 0;
            bool hit = has_k ? ec < top_k && ec + cc >= top_k : m > 0 && em + m >= want;
            unsigned hb = __ballot_sync(FULL, hit);
            int sb = hb ? __ffs(hb) - 1 : -1;
            if (lane == 0) F.sb = sb;
            if (lane == sb) F.sbm0 = em, F.sbc0 = ec;
        }
        __syncthreads();
        const int sb = F.sb;
        if (sb < 0) {  // (CTA-uniform)
            if (t == 0) F.first = INT_MAX;
            __syncthreads();
            return total;
        }
        // fine: warp w reads bin sb * NSB + w of rank `lane`
        v = 0, c = 0;
        if (lane < CL) {
            const k_fast *Fr = cl.map_shared_rank(&F, lane);
            v = Fr->bm[sb * NSB + warp], c = Fr->bc[sb * NSB + warp];
            F.rfc[lane][warp] = c;
        }
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o), c += __shfl_xor_sync(FULL, c, o);
        if (lane == 0) F.gfm[warp] = v, F.gfc[warp] = c;
        __syncthreads();
        if (warp == 0) {  // lane w: bin sb * NSB + w
            double m = F.gfm[lane], im = m;
            int cc = F.gfc[lane], ic = cc;
            for (int o = 1; o < 32; o <<= 1) {
                double tm = __shfl_up_sync(FULL, im, o);
                int tc = __shfl_up_sync(FULL, ic, o);
                if (lane >= o) im += tm, ic += tc;
            }
            double em = __shfl_up_sync(FULL, im, 1);
            int ec = __shfl_up_sync(FULL, ic, 1);
            if (lane == 0) em = 0, ec = 0;
            em += F.sbm0, ec += F.sbc0;
            int bin = sb * NSB + lane;
            // (rounding can leave no bin of the super-bin reaching want: no b, the radix passes)
            bool hit = has_k ? ec < top_k && ec + cc >= top_k : m > 0 && em + m >= want && bin < NB - 1;
            unsigned hb = __ballot_sync(FULL, hit);
            int w = hb ? __ffs(hb) - 1 : -1;
            int n = __shfl_sync(FULL, has_k ? ec + cc : cc, w < 0 ? 0 : w);
            // the candidates of rank `lane` (top-k: every bin up to b; top-p: bin b), summed over the
            // ranks before this CTA's
            int mine = 0;
            if (w >= 0 && lane < CL) {
                if (has_k) {
                    for (int q = 0; q < sb; q++) mine += F.rsc[lane][q];
                    for (int q = 0; q <= w; q++) mine += F.rfc[lane][q];
                } else {
                    mine = F.rfc[lane][w];
                }
            }
            int off = 0;
            for (int r = 0; r < CL; r++) {
                int x = __shfl_sync(FULL, mine, r);
                if (r < rank) off += x;
            }
            if (lane == 0) F.first = w < 0 ? INT_MAX : bin - lane + w, F.n = n, F.off = off;
        }
        __syncthreads();
        return total;
    }
    // the full gather: every thread its bin of every rank
    double gm = 0, total = 0;
    int gc = 0, below = 0;
    if constexpr (CL == 1) {
        __syncthreads();
        gm = F.bm[t], gc = F.bc[t], total = F.ctot;
    } else {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        for (int r = 0; r < CL; r++) {
            const k_fast *Fr = cl.map_shared_rank(&F, r);
            gm += Fr->bm[t];
            int c = Fr->bc[t];
            gc += c;
            if (r < rank) below += c;
            total += Fr->ctot;
        }
    }
    int n_tot, cnt_before = blk_excl_scan_i(gc, S, &n_tot);
    double want = (double)top_p * total, m_tot;
    if (has_k) {
        if (cnt_before + gc >= top_k && cnt_before < top_k) F.first = t;
    } else {
        double m_before = blk_excl_scan_d(gm, S, &m_tot);
        if (gm > 0 && m_before + gm >= want && t < NB - 1) atomicMin(&F.first, t);
    }
    __syncthreads();
    const int b = F.first;
    if (b != INT_MAX) {
        if (t == b) F.n = has_k ? cnt_before + gc : gc, F.off = below;
        if (has_k) {
            int off = blk_sum_i(t <= b ? below : 0, S);
            if (t == 0) F.off = off;
        }
    }
    __syncthreads();
    return total;
}

// The row's token by the candidate-set path; -1 (every CTA alike) when the radix passes must decide
// it; TOK_LATER when the token reaches rank 0's F.tok before the kernel's final cluster barrier.
// mx: max of l, finite. E: the weight cache (NULL: none).
template <int CL>
static __device__ int fast_random(const float *x, const uint32_t *M, chunk_t C, const pd_sample_krow &R, float mx,
                                  k_smem &S, k_fast &F, float *E, int V, bool two_level) {
    const float it = R.inv_temp;
    const bool has_k = R.top_k > 0;  // else top-p alone
    const float thresh = R.log_min_p > -INFINITY ? __fadd_rn(mx, R.log_min_p) : -INFINITY;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = threadIdx.x;
    if (has_k) E = nullptr;                         // top-k weighs its candidates only
    float *hm = (float *)&S.hist[0][0];             // 2 copies (warp parity) of the bin masses
    int *hc = (int *)(hm + 2 * NB);                 // and of the counts
    for (int j = t; j < 2 * NB; j += NT) hm[j] = 0.0f, hc[j] = 0;
    __syncthreads();
    double tsum = 0;
    for (int i0 = C.beg + (t & ~31); i0 < C.end; i0 += NT) {  // warp-uniform trip count
        int i = i0 + lane;
        bool in = i < C.end;
        float l = in ? __fmul_rn(lg(x, M, i), it) : -INFINITY;
        int b = fbin(l, mx);
        unsigned okm = __ballot_sync(FULL, in);
        if (in) {
            unsigned grp = __match_any_sync(okm, b);
            if (lane == __ffs(grp) - 1) atomicAdd(&hc[(warp & 1) * NB + b], __popc(grp));
            if (!has_k) {
                float e = elem_e(l, mx);
                if (E) E[i - C.beg] = e;
                tsum += (double)e;
                if (b < NB - 1 && e > 0.0f) atomicAdd(&hm[(warp & 1) * NB + b], e);
            }
        }
    }
    __syncthreads();
    publish_bins(F, hm, hc);
    if (!has_k) tsum = blk_sum_d(tsum, S);
    if (t == 0) F.ctot = tsum, F.first = INT_MAX, F.last = -1;
    // the boundary bin b: the first whose running count reaches k (top-k), or whose approximate
    // running mass reaches top_p * total (top-p; checked exactly below)
    const double total = boundary<CL>(F, S, C.rank, has_k, R.top_k, R.top_p, two_level);
    double want = (double)R.top_p * total;  // (top-k + top-p: over the top-k set's mass, below)
    const int b = F.first;
    SPROF(1);
    if (b == INT_MAX) return fast_give_up<CL>();
    const int n = F.n, lo_bin = has_k ? 0 : b;
    if (n > CAND || n <= 0) return fast_give_up<CL>();
    const int off = F.off;
    // compaction: this chunk's candidates, in id order, into every CTA at [off, off + its count);
    // top-p: this chunk's weight above the bin, all of it and that at or above the min-p threshold
    int carry = off, ttot;
    double abv = 0, abvm = 0;
    for (int base = C.beg; base < C.end; base += TILE) {
        int i0 = base + t * ITEMS, nl = 0;
        float l[ITEMS];
        bool cd[ITEMS];
        for (int j = 0; j < ITEMS; j++) {
            bool in = i0 + j < C.end;
            l[j] = in ? __fmul_rn(lg(x, M, i0 + j), it) : -INFINITY;
            int bb = fbin(l[j], mx);
            cd[j] = in && bb >= lo_bin && bb <= b;
            nl += cd[j];
            if (!has_k && in && bb < b) {
                double e = (double)(E ? E[i0 + j - C.beg] : elem_e(l[j], mx));
                abv += e;
                if (l[j] >= thresh) abvm += e;
            }
        }
        int pos = blk_excl_scan_i(nl, S, &ttot) + carry;
        carry += ttot;
        for (int j = 0; j < ITEMS; j++) {
            if (!cd[j] || pos >= CAND) continue;  // (pos < CAND: the counts above guarantee it)
            int i = i0 + j;
            uint32_t key = fkey(l[j]);
            float e = E ? E[i - C.beg] : elem_e(l[j], mx);
            if constexpr (CL == 1) {
                F.ck[pos] = key, F.ci[pos] = i, F.ce[pos] = e;
            } else {
                cg::cluster_group cl = cg::this_cluster();
                for (int r = 0; r < CL; r++) {
                    k_fast *Fr = cl.map_shared_rank(&F, r);
                    Fr->ck[pos] = key, Fr->ci[pos] = i, Fr->ce[pos] = e;
                }
            }
            pos++;
        }
    }
    if (!has_k) {
        abv = blk_sum_d(abv, S);
        abvm = blk_sum_d(abvm, S);
        if (t == 0) F.abv = abv, F.abvm = abvm;
    }
    double above = 0;
    if constexpr (CL == 1) {
        __syncthreads();
        above = F.abv;
        if (t == 0) F.wr[0] = F.abvm;
    } else {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (!has_k && two_level) {  // CL remote reads, not NT * CL
            if (t < CL) F.rabv[t] = cl.map_shared_rank(&F, t)->abv, F.wr[t] = cl.map_shared_rank(&F, t)->abvm;
            __syncthreads();
            for (int r = 0; r < CL; r++) above += F.rabv[r];
        } else if (!has_k) {
            for (int r = 0; r < CL; r++) above += cl.map_shared_rank(&F, r)->abv;
            if (t < CL) F.wr[t] = cl.map_shared_rank(&F, t)->abvm;
        }
    }
    SPROF(2);
    // exact rank of candidate t by (key desc, id asc); the array is in id order
    uint32_t kt = t < n ? F.ck[t] : 0u;
    int rank = 0;
    if (t < n)
        for (int j = 0; j < n; j++) {
            uint32_t kj = F.ck[j];
            rank += kj > kt || (kj == kt && j < t);
        }
    float et = t < n ? F.ce[t] : 0.0f;
    if (t < n) F.se[rank] = et;
    if (t == 0) F.first = INT_MAX, F.last = -1;
    __syncthreads();
    SPROF(3);
    // the cut: the last surviving rank P (top-k: k - 1; top-p: where the running mass reaches want)
    const int lim = has_k ? R.top_k : n;  // the ranks the top-p walk covers
    int P = lim - 1;
    if (R.top_p < 1.0f) {
        double w = t < lim ? (double)F.se[t] : 0.0, tot, ex = blk_excl_scan_d(w, S, &tot);
        if (has_k) want = (double)R.top_p * tot;  // top-p over the top-k set's mass
        else if (!(above < want && want <= above + tot)) return fast_give_up<CL>();  // the bin was wrong
        double base = has_k ? 0.0 : above;
        if (w > 0 && base + ex + w >= want) atomicMin(&F.first, t);
        if (w > 0) atomicMax(&F.last, t);
        __syncthreads();
        P = F.first != INT_MAX ? F.first : (F.last >= 0 ? F.last : 0);
        __syncthreads();
        if (t == 0) F.first = INT_MAX, F.last = -1;
    }
    const bool keep = t < n && rank <= P && fval(kt) >= thresh;
    SPROF(4);
    if (has_k) {  // survivors: rank <= P and l >= thresh; the draw in id order, every CTA alike
        double w = keep ? (double)et : 0.0, tot, ex = blk_excl_scan_d(w, S, &tot);
        double r = pd_sample_uniform_of(R.seed, R.draw_idx) * tot;
        if (w > 0 && r < ex + w) atomicMin(&F.first, t);
        if (keep) atomicMax(&F.last, t);
        __syncthreads();
        int pos = F.first != INT_MAX ? F.first : F.last;
        SPROF(6);
        return pos >= 0 ? F.ci[pos] : 0;
    }
    // top-p alone: the cut as (Kc, jc) for the ordered walk; each chunk's surviving mass
    if (t < n && rank == P) F.key = (int)kt;
    if (t < n) F.se[t] = keep ? et : 0.0f;  // (F.se by rank is no longer read)
    __syncthreads();
    const uint32_t Kc = (uint32_t)F.key;
    cut_t cut = {Kc, 0, thresh};
    cut.jc = blk_sum_i(t < n && kt == Kc && rank <= P ? 1 : 0, S);
    int all_eq = blk_sum_i(t < n && kt == Kc ? 1 : 0, S);
    int tie_base = blk_sum_i(t < n && kt == Kc && F.ci[t] < C.beg ? 1 : 0, S);
    if (warp < CL) {  // warp r: chunk r's compacted survivors, summed in a fixed order
        int lo = (int)((int64_t)V * warp / CL), hi = (int)((int64_t)V * (warp + 1) / CL);
        double s = 0;
        for (int j = lane; j < n; j += 32)
            if (F.ci[j] >= lo && F.ci[j] < hi) s += (double)F.se[j];
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
        if (lane == 0) F.wr[warp] += s;
    }
    __syncthreads();
    double before = 0, W = 0, sum = 0;
    int last_nz = -1;  // the last chunk with survivors: it answers when u * S rounds past the end
    for (int q = 0; q < CL; q++) {
        if (q == C.rank) before = sum, W = F.wr[q];
        sum += F.wr[q];
        if (F.wr[q] > 0) last_nz = q;
    }
    double r = pd_sample_uniform_of(R.seed, R.draw_idx) * sum;
    if (W > 0 && r >= before && (r < before + W || C.rank == last_nz)) {  // CTA-uniform: one CTA
        if (E) survivors<true, true>(x, M, C, it, mx, cut, cut.jc < all_eq, tie_base, before, r, S, E);
        else survivors<true, false>(x, M, C, it, mx, cut, cut.jc < all_eq, tie_base, before, r, S, nullptr);
        if (t == 0) {
            int tok = S.token != INT_MAX ? S.token : S.last_keep;
            tok = tok < 0 ? 0 : tok;
            if constexpr (CL == 1) F.tok = tok;
            else cg::this_cluster().map_shared_rank(&F, 0)->tok = tok;
        }
    }
    SPROF(5);
    return TOK_LATER;
}

// ---- the one-read top-p path (top-p without top-k, min-p allowed) --------------------------------
//
// For rows whose chunk fits in shared memory twice (TP_MAX floats: every CTA of a cluster of 8 or
// 16, i.e. batches up to about 16). The chunk is read from global memory once, with every load of
// a thread issued before the first is used, and kept in shared memory: the logits l, then their
// weights exp(l - mx). After that, each thread owns Q = ceil(chunk / NT) consecutive ids (the
// shared arrays are skewed by one float every 32, so that those strided reads hit distinct banks),
// which gives one id-ordered block scan where the candidate-set path above needs one per tile:
//   1  load, l = x * (1/T) (mask applied), max over the cluster
//   2  e = exp(l - mx); bin counts and approximate bin masses (as above); the exact total; the
//      boundary bin b from the cluster's histogram (approximate masses: checked exactly in 4)
//   3  bin b's elements compacted in id order into every CTA (at most CAND, else the radix passes);
//      each thread's exact mass above bin b, all of it and the part at or above the min-p threshold
//   4  candidates ranked exactly by (key desc, id asc); the cut rank P where the running mass (from
//      the exact mass above b) reaches top_p * total; b must hold the cut, else the radix passes
//   5  each chunk's surviving mass (above b with min-p, plus its surviving candidates)
//   6  the one CTA whose mass range holds u * S: one block scan of the threads' surviving masses in
//      id order, and the one thread whose range holds it walks its Q ids
// The survivors are the definition's (every element above b, the ranks <= P of b, min-p applied),
// so only the draw's double sums differ in order from the CPU's.
// PD_CUDA_SAMPLE_TOPP2=0 turns it off (the candidate-set path above decides those rows, as before).
#define TP_MAX 16384                          // largest chunk of the one-read path
#define TP_PAD(n) ((n) + ((n) >> 5) + 1)      // floats of one skewed array of n
#define TP_FLOATS (2 * TP_PAD(TP_MAX))        // the two arrays (l, e), after k_fast
static __device__ __forceinline__ int tp_sk(int i) { return i + (i >> 5); }

// Two block sums at once (every thread gets both).
static __device__ void blk_sum_d2(double &a, double &b, k_smem &S) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(FULL, a, o), b += __shfl_xor_sync(FULL, b, o);
    __syncthreads();
    if (lane == 0) S.red_d[warp] = a, S.scan_d[warp] = b;
    __syncthreads();
    a = S.red_d[lane], b = S.scan_d[lane];
    for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(FULL, a, o), b += __shfl_xor_sync(FULL, b, o);
}

// The row's token (TOK_LATER: it reaches rank 0's F.tok by the kernel's final cluster barrier), or
// -1 (every CTA alike) when the generic flow (max pass, candidate set / radix passes) must decide.
// A: 2 * TP_PAD(chunk) floats of dynamic shared memory.
template <int CL>
static __device__ int topp_row(const float *x, const uint32_t *M, chunk_t C, const pd_sample_krow &R, k_smem &S,
                               k_fast &F, float *A, int V, bool two_level) {
    const float it = R.inv_temp;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, n_el = C.end - C.beg;
    float *L = A, *E = A + TP_PAD(n_el);
    // 1: one read of the chunk (8 loads in flight a thread), the max
    float m = -INFINITY;
    for (int base = 0; base < n_el; base += 8 * NT) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = base + j * NT + t;
            v[j] = i < n_el ? __fmul_rn(lg(x, M, C.beg + i), it) : -INFINITY;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = base + j * NT + t;
            if (i < n_el) L[tp_sk(i)] = v[j];
            m = fmaxf(m, v[j]);
        }
    }
    // the row's max: one cluster barrier (F.pmx is written once a launch; later barriers keep it
    // readable until every CTA has read it)
    float mx = blk_max_f(m, S);  // (its barriers also publish L to the block)
    if constexpr (CL > 1) {
        if (t == 0) F.pmx = mx;
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (t < CL) F.rpmx[t] = cl.map_shared_rank(&F, t)->pmx;
        __syncthreads();
        for (int r = 0; r < CL; r++) mx = fmaxf(mx, F.rpmx[r]);
    }
    SPROF(8);
    if (!isfinite(mx)) return fast_give_up<CL>();
    const float thresh = R.log_min_p > -INFINITY ? __fadd_rn(mx, R.log_min_p) : -INFINITY;
    const int Q = (n_el + NT - 1) / NT, s0 = min(t * Q, n_el), s1 = min(s0 + Q, n_el);
    // 2: weights, histogram (2 copies by warp parity), exact total
    float *hm = (float *)&S.hist[0][0];
    int *hc = (int *)(hm + 2 * NB);
    for (int j = t; j < 2 * NB; j += NT) hm[j] = 0.0f, hc[j] = 0;
    __syncthreads();
    double tsum = 0;
    for (int j = 0; j < Q; j++) {  // warp-uniform trip count
        int i = s0 + j;
        bool in = i < s1;
        float l = in ? L[tp_sk(i)] : -INFINITY;
        int b = fbin(l, mx);
        unsigned okm = __ballot_sync(FULL, in);
        if (in) {
            unsigned grp = __match_any_sync(okm, b);
            if (lane == __ffs(grp) - 1) atomicAdd(&hc[(warp & 1) * NB + b], __popc(grp));
            float e = elem_e(l, mx);
            E[tp_sk(i)] = e;
            tsum += (double)e;
            if (b < NB - 1 && e > 0.0f) atomicAdd(&hm[(warp & 1) * NB + b], e);
        }
    }
    __syncthreads();
    publish_bins(F, hm, hc);
    tsum = blk_sum_d(tsum, S);
    if (t == 0) F.ctot = tsum, F.first = INT_MAX, F.last = -1, F.tok = 0;  // (F.tok: before any remote write)
    const double total = boundary<CL>(F, S, C.rank, false, 0, R.top_p, two_level);
    const double want = (double)R.top_p * total;
    const int b = F.first;
    SPROF(9);
    if (b == INT_MAX) return fast_give_up<CL>();
    const int n = F.n;
    if (n > CAND || n <= 0) return fast_give_up<CL>();
    // 3: compaction of bin b (id order) into every CTA; the thread's mass above b
    int nl = 0;
    double abv = 0, abvm = 0;
    for (int i = s0; i < s1; i++) {
        float l = L[tp_sk(i)];
        int bb = fbin(l, mx);
        nl += bb == b;
        if (bb < b) {
            double e = (double)E[tp_sk(i)];
            abv += e;
            if (l >= thresh) abvm += e;
        }
    }
    int ttot;
    const int pos0 = blk_excl_scan_i(nl, S, &ttot) + F.off;
    if (nl > 0) {
        int pos = pos0;
        for (int i = s0; i < s1 && pos < CAND; i++) {
            float l = L[tp_sk(i)];
            if (fbin(l, mx) != b) continue;
            uint32_t key = fkey(l);
            float e = E[tp_sk(i)];
            if constexpr (CL == 1) {
                F.ck[pos] = key, F.ci[pos] = C.beg + i, F.ce[pos] = e;
            } else {
                cg::cluster_group cl = cg::this_cluster();
                for (int r = 0; r < CL; r++) {
                    k_fast *Fr = cl.map_shared_rank(&F, r);
                    Fr->ck[pos] = key, Fr->ci[pos] = C.beg + i, Fr->ce[pos] = e;
                }
            }
            pos++;
        }
    }
    blk_sum_d2(abv, abvm, S);
    if (t == 0) F.abv = abv, F.abvm = abvm;
    double above = 0;
    if constexpr (CL == 1) {
        __syncthreads();
        above = F.abv;
        if (t == 0) F.wr[0] = F.abvm;
    } else {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (t < CL) F.rabv[t] = cl.map_shared_rank(&F, t)->abv, F.wr[t] = cl.map_shared_rank(&F, t)->abvm;
        __syncthreads();
        for (int r = 0; r < CL; r++) above += F.rabv[r];
    }
    SPROF(10);
    // 4: exact ranks (the array is in id order), the cut rank P
    uint32_t kt = t < n ? F.ck[t] : 0u;
    int rank = 0;
    if (t < n)
        for (int j = 0; j < n; j++) {
            uint32_t kj = F.ck[j];
            rank += kj > kt || (kj == kt && j < t);
        }
    if (t < n) F.se[rank] = F.ce[t], F.rk[t] = rank;
    if (t == 0) F.first = INT_MAX, F.last = -1;
    __syncthreads();
    {
        double w = t < n ? (double)F.se[t] : 0.0, tot, ex = blk_excl_scan_d(w, S, &tot);
        if (!(above < want && want <= above + tot)) return fast_give_up<CL>();  // the bin was wrong
        if (w > 0 && above + ex + w >= want) atomicMin(&F.first, t);
        if (w > 0) atomicMax(&F.last, t);
    }
    __syncthreads();
    const int P = F.first != INT_MAX ? F.first : (F.last >= 0 ? F.last : 0);
    SPROF(11);
    // 5: the surviving candidates (by position) and every chunk's surviving mass
    if (t < n) F.se[t] = F.rk[t] <= P && fval(kt) >= thresh ? F.ce[t] : 0.0f;  // (F.se by rank: read above)
    __syncthreads();
    if (warp < CL) {  // warp r: chunk r's surviving candidates, summed in a fixed order
        int lo = (int)((int64_t)V * warp / CL), hi = (int)((int64_t)V * (warp + 1) / CL);
        double s = 0;
        for (int j = lane; j < n; j += 32)
            if (F.ci[j] >= lo && F.ci[j] < hi) s += (double)F.se[j];
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
        if (lane == 0) F.wr[warp] += s;
    }
    __syncthreads();
    double before = 0, W = 0, sum = 0;
    int last_nz = -1;  // the last chunk with survivors: it answers when u * S rounds past the end
    for (int q = 0; q < CL; q++) {
        if (q == C.rank) before = sum, W = F.wr[q];
        sum += F.wr[q];
        if (F.wr[q] > 0) last_nz = q;
    }
    SPROF(12);
    const double r = pd_sample_uniform_of(R.seed, R.draw_idx) * sum;
    if (W > 0 && r >= before && (r < before + W || C.rank == last_nz)) {  // CTA-uniform: one CTA
        // 6: the threads' surviving masses in id order (one scan), then one thread's walk
        if (t == 0) S.token = INT_MAX, S.last_keep = -1;
        double tw = 0;
        int last = -1;
        for (int i = s0, pos = pos0; i < s1; i++) {
            float l = L[tp_sk(i)];
            int bb = fbin(l, mx);
            float w = bb < b ? (l >= thresh ? E[tp_sk(i)] : 0.0f) : bb == b ? F.se[pos++] : 0.0f;
            tw += (double)w;
            if (w > 0) last = C.beg + i;
        }
        double tot, ex = blk_excl_scan_d(tw, S, &tot) + before;  // (its barriers order S.token's reset)
        if (last >= 0) atomicMax(&S.last_keep, last);
        if (tw > 0 && r >= ex && r < ex + tw) {
            double acc = ex;
            int tok = last;  // rounding: r inside the thread's range but past its running sum
            for (int i = s0, pos = pos0; i < s1; i++) {
                float l = L[tp_sk(i)];
                int bb = fbin(l, mx);
                float w = bb < b ? (l >= thresh ? E[tp_sk(i)] : 0.0f) : bb == b ? F.se[pos++] : 0.0f;
                acc += (double)w;
                if (w > 0 && r < acc) {
                    tok = C.beg + i;
                    break;
                }
            }
            atomicMin(&S.token, tok);
        }
        __syncthreads();
        if (t == 0) {
            int tok = S.token != INT_MAX ? S.token : S.last_keep;
            tok = tok < 0 ? 0 : tok;
            if constexpr (CL == 1) F.tok = tok;
            else cg::this_cluster().map_shared_rank(&F, 0)->tok = tok;
        }
    }
    SPROF(13);
    return TOK_LATER;
}

static_assert(NB == NT && CAND == NT, "the candidate-set scans take one bin / candidate a thread");

// Row r of the launch's own parameters, read at constant offsets (a run-time index into a kernel
// parameter would copy the whole parameter block to local memory).
static_assert(PD_SAMPLE_KINLINE == 8, "inline_row() lists every slot");
static __device__ __forceinline__ pd_sample_krow inline_row(const pd_sample_kinline &in, int r) {
    switch (r) {
    case 0: return in.rows[0];
    case 1: return in.rows[1];
    case 2: return in.rows[2];
    case 3: return in.rows[3];
    case 4: return in.rows[4];
    case 5: return in.rows[5];
    case 6: return in.rows[6];
    default: return in.rows[7];
    }
}

// One row by the cluster (the kernels' body). FAST: the candidate-set path for the rows that
// truncate (top-k; top-p from clusters of p.topp_min_cl CTAs); a separate instance, so that
// launches without truncating rows (greedy, temperature, min-p) run the previous kernel's code.
template <int CL, bool FAST>
static __device__ __forceinline__ void sample_row(const pd_sample_kparams p, const pd_sample_krow R, int row, k_smem &S,
                                                  unsigned char *dyn_smem) {
    SPROF_START();
    int V = p.vocab;
    chunk_t C;
    C.rank = (int)(blockIdx.x % CL);
    C.beg = (int)((int64_t)V * C.rank / CL), C.end = (int)((int64_t)V * (C.rank + 1) / CL);
    float *x = p.logits + (size_t)row * (size_t)V;
    const uint32_t *M = R.mask_row >= 0 ? p.masks + (size_t)R.mask_row * (size_t)p.mask_words : nullptr;
    float lse = 0;
    if (R.n_logprobs >= 0) lse = raw_logprobs<CL>(x, C, V, R.n_logprobs, S);
    if (R.n_pens > 0) penalties(x, C, R, p.pens, p.pen_raw, false);
    int token;
    if (R.is_greedy) {
        float bv = -INFINITY;
        int bi = C.beg;
        for (int i = C.beg + threadIdx.x; i < C.end; i += NT) {
            float v = lg(x, M, i);
            if (v > bv) bv = v, bi = i;  // ascending i: the first maximum of this thread
        }
        token = clu_argmax<CL>(bv, bi, S);
    } else {
        token = -1;
        bool tp_tried = false;  // the one-read top-p path gave up: straight to the radix passes
        if constexpr (FAST) {
            if ((p.fast & PD_SAMPLE_FAST_TOPP2) && R.top_k == 0 && R.top_p < 1.0f && CL >= p.topp_min_cl &&
                2 * TP_PAD(C.end - C.beg) <= p.ecache) {
                token = topp_row<CL>(x, M, C, R, S, *(k_fast *)dyn_smem, (float *)(dyn_smem + sizeof(k_fast)), V,
                                     p.fast & PD_SAMPLE_FAST_GATHER2);
                tp_tried = true;
            }
        }
        float mx = -INFINITY;
        if (token == -1) {
            for (int i = C.beg + threadIdx.x; i < C.end; i += NT) mx = fmaxf(mx, __fmul_rn(lg(x, M, i), R.inv_temp));
            mx = clu_max_f<CL>(mx, S);
            SPROF(0);
        }
        if constexpr (FAST) {
            if (token == -1 && (R.top_k > 0 || (R.top_p < 1.0f && CL >= p.topp_min_cl && !tp_tried)) && isfinite(mx)) {
                float *E = p.ecache > 0 && C.end - C.beg <= p.ecache ? (float *)(dyn_smem + sizeof(k_fast)) : nullptr;
                token = fast_random<CL>(x, M, C, R, mx, S, *(k_fast *)dyn_smem, E, V, p.fast & PD_SAMPLE_FAST_GATHER2);
            }
        }
        if (token == -1) {  // the radix passes: not a fast row, no finite max, or too many candidates
            cut_t c = truncate<CL>(x, M, C, R, mx, S);
            token = draw<CL>(x, M, C, R, mx, c, S);
            SPROF(7);
        }
    }
    if (R.n_pens > 0) penalties(x, C, R, p.pens, p.pen_raw, true);
    if constexpr (CL > 1) {  // the undone penalties of every chunk, before rank 0 reads x[token]
        __threadfence();
        cg::this_cluster().sync();
    }
    SPROF(15);
    if (C.rank == 0 && threadIdx.x == 0) {
        if constexpr (FAST) {
            if (token == TOK_LATER) token = ((const k_fast *)dyn_smem)->tok;
        }
        pd_sample_kout *o = &p.out[row];
        int n_top = R.n_logprobs > 0 ? S.n_top : 0;
        o->logprob = R.n_logprobs >= 0 ? __fsub_rn(x[token], lse) : 0.0f;
        o->n_top = n_top;
        for (int j = 0; j < n_top; j++) o->top_ids[j] = S.top_ids[j], o->top_logprobs[j] = __fsub_rn(S.top_vals[j], lse);
        // the token last, after the rest is visible to the host: the shim may poll it in mapped
        // memory (PD_SAMPLE_PENDING until then) instead of waiting for the stream
        __threadfence_system();
        *(volatile int32_t *)&o->token = token;
    }
    SPROF_FLUSH();
}

// The rows in device (or mapped) memory, p.rows.
template <int CL, bool FAST> static __global__ void __launch_bounds__(NT) k_sample(const pd_sample_kparams p) {
    __shared__ k_smem S;
    extern __shared__ __align__(16) unsigned char dyn_smem[];  // FAST: [k_fast | weight cache]
    int row = blockIdx.x / CL;
    sample_row<CL, FAST>(p, p.rows[row], row, S, dyn_smem);
}

// The rows in the launch's own parameters (no copy before the launch). A kernel of its own: a
// 592-byte parameter block in k_sample changed the code generated for the whole kernel (PTX of the
// plain instance no longer the previous kernel's; greedy / temperature launches of 64-256 rows
// measured 15-50 us slower, op_bench sample, tools/gpu/NOTES.md).
template <int CL, bool FAST>
static __global__ void __launch_bounds__(NT) k_sample_inl(const pd_sample_kparams p, const pd_sample_kinline in) {
    __shared__ k_smem S;
    extern __shared__ __align__(16) unsigned char dyn_smem[];
    int row = blockIdx.x / CL;
    sample_row<CL, FAST>(p, inline_row(in, row), row, S, dyn_smem);
}

// ---- launch ------------------------------------------------------------------------------------

// Dynamic shared memory of a FAST launch: the candidate-set arrays, then the weight cache.
#define DYN_MAX (sizeof(k_fast) + sizeof(float) * (ECACHE_MAX > TP_FLOATS ? ECACHE_MAX : TP_FLOATS))
static_assert(DYN_MAX + sizeof(k_smem) <= 227 * 1024, "the FAST instance's shared memory exceeds an sm_90 CTA's");

template <int CL, bool FAST, bool INL>
static cudaError_t launch_as(const pd_sample_kparams *p, const pd_sample_kinline *in, cudaStream_t s) {
    size_t dyn = FAST ? sizeof(k_fast) + sizeof(float) * (size_t)p->ecache : 0;
    if constexpr (CL == 1) {
        if constexpr (INL) k_sample_inl<1, FAST><<<p->n_rows, NT, dyn, s>>>(*p, *in);
        else k_sample<1, FAST><<<p->n_rows, NT, dyn, s>>>(*p);
        return cudaGetLastError();
    } else {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((unsigned)p->n_rows * CL);
        cfg.blockDim = dim3(NT);
        cfg.dynamicSmemBytes = dyn;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = CL, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        if constexpr (INL) return cudaLaunchKernelEx(&cfg, k_sample_inl<CL, FAST>, *p, *in);
        else return cudaLaunchKernelEx(&cfg, k_sample<CL, FAST>, *p);
    }
}
template <int CL> static cudaError_t launch(const pd_sample_kparams *p, const pd_sample_kinline *in, cudaStream_t s) {
    if (p->rows) return p->fast ? launch_as<CL, true, false>(p, in, s) : launch_as<CL, false, false>(p, in, s);
    return p->fast ? launch_as<CL, true, true>(p, in, s) : launch_as<CL, false, true>(p, in, s);
}

// Per device: how many clusters of each size (index log2 CL) can be resident at once (0: none).
struct dev_info {
    int ready, n_sm, max_clusters[5], fast_ok;  // fast_ok: every FAST instance takes DYN_MAX
};
static dev_info g_dev[64];

// Counted for the plain instance (one 1024-thread CTA an SM either way: the registers allow no
// second, so the FAST instance's shared memory changes nothing). Also lets the FAST instance take
// DYN_MAX bytes of dynamic shared memory (*fast_ok cleared when the device refuses).
template <int CL> static int clusters_resident(int *fast_ok) {
    if (cudaFuncSetAttribute(k_sample<CL, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)DYN_MAX) != cudaSuccess ||
        cudaFuncSetAttribute(k_sample_inl<CL, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)DYN_MAX) != cudaSuccess)
        *fast_ok = 0;
    if constexpr (CL == 1) {
        return 1;
    } else {
        if constexpr (CL == 16) {
            cudaFuncAttribute np = cudaFuncAttributeNonPortableClusterSizeAllowed;
            if (cudaFuncSetAttribute(k_sample<16, true>, np, 1) != cudaSuccess ||
                cudaFuncSetAttribute(k_sample_inl<16, true>, np, 1) != cudaSuccess)
                *fast_ok = 0;
            if (cudaFuncSetAttribute(k_sample<16, false>, np, 1) != cudaSuccess ||
                cudaFuncSetAttribute(k_sample_inl<16, false>, np, 1) != cudaSuccess)
                return 0;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(CL);
        cfg.blockDim = dim3(NT);
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = CL, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, k_sample<CL, false>, &cfg) != cudaSuccess) n = 0;
        return n;
    }
}

static const dev_info *dev_of(void) {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= 64) d = 0;
    dev_info *di = &g_dev[d];
    if (__atomic_load_n(&di->ready, __ATOMIC_ACQUIRE)) return di;
    int n_sm = 1, major = 0;
    cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, d);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d);
    di->n_sm = n_sm > 0 ? n_sm : 1;
    di->max_clusters[0] = di->n_sm;
    di->fast_ok = 1;
    (void)clusters_resident<1>(&di->fast_ok);
    if (major >= 9) {
        di->max_clusters[1] = clusters_resident<2>(&di->fast_ok);
        di->max_clusters[2] = clusters_resident<4>(&di->fast_ok);
        di->max_clusters[3] = clusters_resident<8>(&di->fast_ok);
        di->max_clusters[4] = clusters_resident<16>(&di->fast_ok);
    }
    (void)cudaGetLastError();  // a refused query leaves no sticky error
    __atomic_store_n(&di->ready, 1, __ATOMIC_RELEASE);
    return di;
}

// Read at every call (cheap next to the launch), so that a test can try every cluster size.
static int env_cluster(void) {
    const char *e = getenv("PD_CUDA_SAMPLE_CLUSTER");
    int c = e ? atoi(e) : 0;
    return c == 1 || c == 2 || c == 4 || c == 8 || c == 16 ? c : 0;
}

// PD_CUDA_SAMPLE_FAST=0: the radix passes only (the previous kernel's path), for A/B runs and tests.
static int env_fast(void) {
    const char *e = getenv("PD_CUDA_SAMPLE_FAST");
    return !(e && !strcmp(e, "0"));
}

// PD_CUDA_SAMPLE_GATHER=0: every CTA of a cluster reads every bin of every CTA's histogram (the
// session-8 gather) instead of the two-level gather (boundary()), for A/B runs and tests.
static int env_gather2(void) {
    const char *e = getenv("PD_CUDA_SAMPLE_GATHER");
    return !(e && !strcmp(e, "0"));
}

// PD_CUDA_SAMPLE_TOPP2=0: top-p rows without top-k skip the one-read path (the candidate-set path
// of session 8 decides them), for A/B runs and tests.
static int env_topp2(void) {
    const char *e = getenv("PD_CUDA_SAMPLE_TOPP2");
    return !(e && !strcmp(e, "0"));
}

// Rows with top-p and no top-k take the candidate-set path from this cluster size on (smaller
// clusters, i.e. larger batches: the radix passes). PD_CUDA_SAMPLE_TOPP_MIN_CL=1..32 overrides.
#define TOPP_MIN_CL 1
static int env_topp_min_cl(void) {
    const char *e = getenv("PD_CUDA_SAMPLE_TOPP_MIN_CL");
    int c = e ? atoi(e) : 0;
    return c >= 1 && c <= 32 ? c : TOPP_MIN_CL;
}

extern "C" void pd_cuda_sample(const pd_sample_kparams *p_in, const pd_sample_kinline *in, cudaStream_t s) {
    if (p_in->n_rows <= 0) return;
    const dev_info *di = dev_of();
    pd_sample_kparams q = *p_in, *p = &q;
    int cl = env_cluster(), lg = 0;
    if (cl == 0) {  // the largest cluster with every row's cluster resident at once, >= 1024 ids a CTA
        cl = 1;
        // Greedy only: one pass, where a cluster's barriers and launch cost more than they save from
        // 9 rows on (op_bench sample: V = 128256, 64 rows, 23 us one CTA a row, 32 us two).
        while (lg < 4 && p->n_rows <= di->max_clusters[lg + 1] && p->vocab >= cl * 2 * NT && !(p->all_greedy && p->n_rows > 8))
            cl *= 2, lg++;
    } else {
        while ((1 << lg) < cl) lg++;
        if (di->max_clusters[lg] <= 0) cl = 1;  // this device has no such cluster
    }
    // The FAST instance when some row truncates (top-k / top-p); each CTA caches its chunk's
    // weights (top-p rows) when the chunk fits in ECACHE_MAX floats.
    int chunk = (int)(((int64_t)p->vocab + cl - 1) / cl);
    p->fast = env_fast() && p->any_trunc && di->fast_ok;
    p->topp_min_cl = env_topp_min_cl();
    p->ecache = p->fast && chunk <= ECACHE_MAX ? chunk : 0;
    if (p->fast && env_gather2()) p->fast |= PD_SAMPLE_FAST_GATHER2;
    if (p->fast && env_topp2() && chunk <= TP_MAX) {  // the one-read top-p path: room for l and e
        p->fast |= PD_SAMPLE_FAST_TOPP2;
        if (p->ecache < 2 * TP_PAD(chunk)) p->ecache = 2 * TP_PAD(chunk);
    }
    cudaError_t e;
    switch (cl) {
    case 16: e = launch<16>(p, in, s); break;
    case 8: e = launch<8>(p, in, s); break;
    case 4: e = launch<4>(p, in, s); break;
    case 2: e = launch<2>(p, in, s); break;
    default: e = launch<1>(p, in, s); break;
    }
    if (e != cudaSuccess && cl > 1) {  // a cluster the device refused: one CTA per row
        (void)cudaGetLastError();
        p->fast &= ~PD_SAMPLE_FAST_TOPP2;  // (a chunk of the whole vocabulary: the cache only)
        p->ecache = p->fast && p->vocab <= ECACHE_MAX ? p->vocab : 0;
        (void)launch<1>(p, in, s);
    }
}
