// skinny_mma.cu — tensor-core skinny GEMM for decode and speculative verify (M <= 16):
// out (M, N) = a (M, K) . w(N, K)^T, bound by streaming the weight once from HBM.
//
// Why: the row-streaming kernel (skinny.cu) does M f32 FMAs plus the bf16 unpack per weight
// element on the CUDA cores; from M ~ 5 it is issue-bound (at M = 8 it was slower than cuBLASLt on
// every Llama-3-8B shape). Here the products run on the tensor cores, with A and B swapped: the
// weight rows are the MMA's M side (mma.sync.m16n8k16 bf16 -> f32, 16 weight rows x 16 k per
// instruction) and the M activation rows its n = 8 side (M = 9..16: two n-tiles), so one
// instruction does 16 x 8 x 16 products and the per-element cost no longer grows with M.
//
// Fragments straight from the 16-byte loads (no shared memory, no ldmatrix): the sum over k does
// not care in which order the 16 k of an MMA are paired, as long as A and B use the same order. Lane
// (g = lane / 4, t = lane % 4) loads 16-byte chunk c (8 consecutive k) of weight rows g and g + 8 and
// the same chunk of activation row g; its A registers for the first MMA are (row g k0 k1,
// row g+8 k0 k1, row g k2 k3, row g+8 k2 k3) and its B registers (act k0 k1, act k2 k3); the second
// MMA takes k4..k7 the same way. Every lane of a warp uses the same c for the same t, so the 16
// logical k of an MMA are 16 distinct physical k and A and B agree on them.
//
// Tiling: a 128-thread block owns T x 16 consecutive weight rows (T = 1 or 2) and the whole K; its
// 4 warps split K (warp w, step s, lane t: chunk (4 s + w) x 4 + t, so a step of the block reads
// 256 contiguous bytes of each row). Every thread has 16 independent 16-byte
// ld.global.nc.L1::no_allocate weight loads in flight per batch (U = 8 / T steps x T tiles x 2
// rows); the first batch is issued before the PDL wait (weights are never written by a kernel).
// Activations come through L1 (__ldg; every block of an SM reads the same rows), the zero rows
// past M are not loaded. No split-K and no workspace: N = 4096 gives 256 blocks of 16 rows, which
// are all resident at once (2 per SM, 8 SMs with 1: ~3% imbalance, not a second wave). The K
// reduction across the 4 warps goes through shared memory at the end; threads then add bias /
// the previous output and store (consecutive threads, consecutive output columns).
#include "kernels/common.cuh"
#include "kernels/skinny_mma.cuh"

#define PD_K_SM_THREADS 128
#define PD_K_SM_WARPS (PD_K_SM_THREADS / 32)
#define PD_K_SM_STEP (PD_K_SM_WARPS * 4)  // chunks of a row one step of the block covers
#define PD_K_SM_LOADS 16                   // 16-byte weight loads in flight per thread

typedef struct pd_k_skinny_mma_args {
    const __nv_bfloat16 *a, *w, *bias;
    void *out;
    int M, N, K, lda, accumulate, out_f32, hf;
    // rope epilogue
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    __nv_bfloat16 *k_cache, *v_cache;
    int H, Hkv, hd;
    float attn_scaling;
} pd_k_skinny_mma_args;

// Epilogues (skinny_mma.cuh): plain (bias, accumulate, f32 out), residual, glu, rope.
enum { PD_K_SM_PLAIN = 0, PD_K_SM_RESIDUAL = 1, PD_K_SM_GLU = 2, PD_K_SM_ROPE = 3 };

// The weight chunks c + u * STEP (u < U) of the 2 T rows of this lane; chunks past the row's end
// read as zero.
template <int T, int U>
static __device__ __forceinline__ void pd_k_sm_load(uint4 (&wv)[U][T][2], const uint4 *const (&wr)[T][2], int c,
                                                    int chunks) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int i = 0; i < T; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                wv[u][i][h] = c + u * PD_K_SM_STEP < chunks ? pd_k_ld_stream(wr[i][h] + c + u * PD_K_SM_STEP)
                                                            : make_uint4(0, 0, 0, 0);
}

// The MMAs of one batch: U steps from the warp's chunk cb (weights in wv, already loaded), the
// activation chunks loaded here (through L1), zero past the end of K or for rows past M.
template <int T, int NT, int U>
static __device__ __forceinline__ void pd_k_sm_batch(float (&acc)[T][NT][4], const uint4 (&wv)[U][T][2],
                                                     const uint4 *const (&ar)[NT], const bool (&a_on)[NT], int cb,
                                                     int t, int chunks) {
    // The activation chunks in groups of AG steps (all U at once for 16 loads in flight; 4 at a
    // time for 32, which would otherwise hold 64 more registers and fit fewer blocks per SM).
    constexpr int AG = U > 8 ? 4 : U;
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += AG) {
        if (cb + u0 * PD_K_SM_STEP >= chunks) break;  // warp-uniform
        uint4 av[AG][NT];
#pragma unroll
        for (int u = 0; u < AG; u++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                int c = cb + t + (u0 + u) * PD_K_SM_STEP;
                av[u][j] = a_on[j] && c < chunks ? __ldg(ar[j] + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < AG; u++) {
            if (cb + (u0 + u) * PD_K_SM_STEP >= chunks) break;  // warp-uniform; the lanes past the end hold zeros
#pragma unroll
            for (int i = 0; i < T; i++) {
                const uint4 &w0 = wv[u0 + u][i][0], &w1 = wv[u0 + u][i][1];
                const uint32_t a0[4] = {w0.x, w1.x, w0.y, w1.y};
                const uint32_t a1[4] = {w0.z, w1.z, w0.w, w1.w};
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    pd_k_mma_bf16(acc[i][j], a0, av[u][j].x, av[u][j].y);
                    pd_k_mma_bf16(acc[i][j], a1, av[u][j].z, av[u][j].w);
                }
            }
        }
    }
}

// T: 16-row tiles per block; NT: 8-column n-tiles (activation rows), 1 for M <= 8, 2 for M <= 16.
// PIPE: two register sets of half the loads each; the next batch's loads are issued before the
// current batch's MMAs (loads always in flight), instead of one set refilled after them.
// EPI: PD_K_SM_PLAIN / RESIDUAL (tile i, half h: weight rows row0 + 16 i + 8 h + g), GLU (T = 1:
// gate rows p0 + g in the first half, the up rows N + p0 + g in the second, p0 = 8 blockIdx.x) or
// ROPE (T = 1: the first (H + Hkv) hd / 16 blocks rotate rows i0 + g and i0 + hd/2 + g of one q / k
// head, i0 a multiple of 8; the rest own 16 consecutive v rows).
// L: 16-byte weight loads in flight per thread (PD_K_SM_LOADS, or 32 (T = 1): twice the bytes in
// flight per block, for grids too small to fill every SM with blocks: N = 4096 gives 256 blocks).
template <int T, int NT, bool PIPE, int EPI, int L>
static __global__ void __launch_bounds__(PD_K_SM_THREADS) k_skinny_mma(pd_k_skinny_mma_args p) {
    constexpr int U = L / (2 * T) / (PIPE ? 2 : 1), BATCH = U * PD_K_SM_STEP;
    static_assert(EPI == PD_K_SM_PLAIN || EPI == PD_K_SM_RESIDUAL || T == 1, "glu / rope blocks are one 16-row tile");
    pd_k_pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int chunks = p.K >> 3, half = p.hd >> 1;
    int row0 = blockIdx.x * (EPI == PD_K_SM_GLU ? 8 : 16 * T);
    const int rot_blocks = EPI == PD_K_SM_ROPE ? (p.H + p.Hkv) * half / 8 : 0;
    const bool rot = EPI == PD_K_SM_ROPE && (int)blockIdx.x < rot_blocks;
    if (EPI == PD_K_SM_ROPE) {
        if (rot) {  // head hh, pairs i0 .. i0 + 7
            int per = half / 8, hh = (int)blockIdx.x / per;
            row0 = hh * p.hd + ((int)blockIdx.x - hh * per) * 8;
        } else {
            row0 = (p.H + p.Hkv) * p.hd + ((int)blockIdx.x - rot_blocks) * 16;
        }
    }
    const uint4 *wr[T][2];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {  // rows past N repeat the last row; their sums are not stored
            int n;
            if (EPI == PD_K_SM_GLU) n = min(row0 + g, p.N - 1) + h * p.N;
            else if (EPI == PD_K_SM_ROPE && rot) n = row0 + g + h * half;
            else n = min(row0 + 16 * i + 8 * h + g, p.N - 1);
            wr[i][h] = (const uint4 *)(p.w + (size_t)n * p.K);
        }
    // cb: the warp's first chunk of the batch (warp-uniform: the loop's exits must be, every lane
    // of the warp runs each mma.sync); this lane's chunk is cb + t.
    int cb = warp * 4;
    uint4 wa[U][T][2], wb[U][T][2];
    pd_k_sm_load<T, U>(wa, wr, cb + t, chunks);
    if (PIPE && cb + BATCH < chunks) pd_k_sm_load<T, U>(wb, wr, cb + BATCH + t, chunks);
    pd_k_pdl_wait();  // the activations (and out) belong to earlier kernels

    const uint4 *ar[NT];
    bool a_on[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        a_on[j] = 8 * j + g < p.M;
        ar[j] = (const uint4 *)(p.a + (size_t)(a_on[j] ? 8 * j + g : 0) * p.lda);
    }
    float acc[T][NT][4];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    for (;;) {
        pd_k_sm_batch<T, NT, U>(acc, wa, ar, a_on, cb, t, chunks);
        cb += BATCH;
        if (cb >= chunks) break;
        if (!PIPE) {
            pd_k_sm_load<T, U>(wa, wr, cb + t, chunks);
            continue;
        }
        // wb holds batch cb (loaded one batch ago); refill wa with batch cb + BATCH first
        if (cb + BATCH < chunks) pd_k_sm_load<T, U>(wa, wr, cb + BATCH + t, chunks);
        pd_k_sm_batch<T, NT, U>(acc, wb, ar, a_on, cb, t, chunks);
        cb += BATCH;
        if (cb >= chunks) break;
        if (cb + BATCH < chunks) pd_k_sm_load<T, U>(wb, wr, cb + BATCH + t, chunks);
    }

    // acc[i][j]: (row 16 i + g, col 8 j + 2 t), (.., 2 t + 1), (row 16 i + g + 8, 2 t), (.., 2 t + 1).
    constexpr int ROWS = 16 * T, COLS = 8 * NT;
    __shared__ float red[PD_K_SM_WARPS][COLS][ROWS + 1];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][8 * j + 2 * t + (e & 1)][16 * i + g + 8 * (e >> 1)] = acc[i][j][e];
    __syncthreads();
    if (EPI == PD_K_SM_GLU || (EPI == PD_K_SM_ROPE && rot)) {  // pairs: row j with row j + 8
        for (int idx = tid; idx < 8 * COLS; idx += PD_K_SM_THREADS) {
            int m = idx >> 3, j = idx & 7, n0 = row0 + j;
            if (m >= p.M || (EPI == PD_K_SM_GLU && n0 >= p.N)) continue;
            float x0 = 0.f, x1 = 0.f;
#pragma unroll
            for (int w = 0; w < PD_K_SM_WARPS; w++) x0 += red[w][m][j], x1 += red[w][m][j + 8];
            if (EPI == PD_K_SM_GLU) {
                if (p.bias) x0 += __bfloat162float(p.bias[n0]), x1 += __bfloat162float(p.bias[p.N + n0]);
                float gt = pd_k_bf16r(x0), up = pd_k_bf16r(x1), sg = pd_k_silu(gt);  // the stored gate_up
                ((__nv_bfloat16 *)p.out)[(size_t)m * p.N + n0] = __float2bfloat16((p.hf ? pd_k_bf16r(sg) : sg) * up);
                continue;
            }
            int n1 = n0 + half, h = n0 / p.hd, i = n0 - h * p.hd;
            if (p.bias) x0 += __bfloat162float(p.bias[n0]), x1 += __bfloat162float(p.bias[n1]);
            float y0, y1;  // from the stored (rounded) q / k, as rope_kv.cu reads them
            pd_k_rope_pair(pd_k_bf16r(x0), pd_k_bf16r(x1), (float)p.positions[m], p.inv_freq[i], p.attn_scaling, p.hf,
                           &y0, &y1);
            __nv_bfloat16 b0 = __float2bfloat16(y0), b1 = __float2bfloat16(y1);
            __nv_bfloat16 *qkv = (__nv_bfloat16 *)p.out + (size_t)m * p.N;
            qkv[n0] = b0;
            qkv[n1] = b1;
            int slot = p.slot_mapping[m];
            if (h >= p.H && slot >= 0) {
                __nv_bfloat16 *kd = p.k_cache + (size_t)slot * p.Hkv * p.hd + (size_t)(h - p.H) * p.hd;
                kd[i] = b0;
                kd[i + half] = b1;
            }
        }
        return;
    }
    for (int idx = tid; idx < ROWS * COLS; idx += PD_K_SM_THREADS) {
        int m = idx / ROWS, r = idx - m * ROWS, n = row0 + r;
        if (m >= p.M || n >= p.N) continue;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < PD_K_SM_WARPS; w++) v += red[w][m][r];
        if (p.bias) v += __bfloat162float(p.bias[n]);
        size_t o = (size_t)m * p.N + n;
        if (EPI == PD_K_SM_ROPE) {  // a v row: qkv and the cache
            __nv_bfloat16 bv = __float2bfloat16(v);
            ((__nv_bfloat16 *)p.out)[o] = bv;
            int slot = p.slot_mapping[m];
            if (slot >= 0) p.v_cache[(size_t)slot * p.Hkv * p.hd + (size_t)(n - (p.H + p.Hkv) * p.hd)] = bv;
        } else if (EPI == PD_K_SM_RESIDUAL) {
            pd_k_gemm_out_residual(p.out, o, v);
        } else {
            pd_k_gemm_out(p.out, o, v, p.out_f32, p.accumulate);
        }
    }
}

extern "C" int pd_cuda_skinny_mma_supported(int M, int K, int lda, const void *a, const void *w) {
    return M >= 1 && M <= PD_SKINNY_MMA_MAX_M && K > 0 && K % 8 == 0 && lda % 8 == 0 && ((uintptr_t)a & 15) == 0 &&
           ((uintptr_t)w & 15) == 0;
}

template <int T, bool PIPE, int EPI, int L>
static void pd_k_skinny_mma_launch_t(const pd_k_skinny_mma_args &a, cudaStream_t s) {
    unsigned n_blocks = (unsigned)((a.N + 16 * T - 1) / (16 * T));
    if (EPI == PD_K_SM_GLU) n_blocks = (unsigned)((a.N + 7) / 8);
    if (EPI == PD_K_SM_ROPE)  // rotation blocks (8 pairs each), then v blocks
        n_blocks = (unsigned)((a.H + a.Hkv) * (a.hd / 2) / 8 + (a.Hkv * a.hd + 15) / 16);
    dim3 grid(n_blocks), block(PD_K_SM_THREADS);
    if (a.M <= 8) pd_k_launch(k_skinny_mma<T, 1, PIPE, EPI, L>, grid, block, 0, s, a);
    else pd_k_launch(k_skinny_mma<T, 2, PIPE, EPI, PD_K_SM_LOADS>, grid, block, 0, s, a);  // (32: spills)
}

// One 16-row tile per block, single- or double-buffered; 32 loads in flight per thread only
// single-buffered at M <= 8 (221-223 registers, no spills; double-buffered or at M > 8 it spills).
template <int EPI>
static void pd_k_skinny_mma_launch_e(const pd_k_skinny_mma_args &a, bool pipe, int loads, cudaStream_t s) {
    if (loads == 32 && !pipe && a.M <= 8) pd_k_skinny_mma_launch_t<1, false, EPI, 32>(a, s);
    else if (pipe) pd_k_skinny_mma_launch_t<1, true, EPI, PD_K_SM_LOADS>(a, s);
    else pd_k_skinny_mma_launch_t<1, false, EPI, PD_K_SM_LOADS>(a, s);
}

extern "C" void pd_cuda_skinny_mma(const pd_skinny_mma_kparams *p, cudaStream_t s) {
    pd_k_skinny_mma_args a;
    a.a = (const __nv_bfloat16 *)p->a;
    a.w = (const __nv_bfloat16 *)p->w;
    a.bias = (const __nv_bfloat16 *)p->bias;
    a.out = p->out;
    a.M = p->M, a.N = p->N, a.K = p->K, a.lda = p->lda ? p->lda : p->K;
    a.accumulate = p->accumulate, a.out_f32 = p->out_f32;
    a.hf = pd_k_hf_rounding();
    const pd_skinny_rope *r = &p->rope_kv;
    a.positions = r->positions, a.slot_mapping = r->slot_mapping, a.inv_freq = r->inv_freq;
    a.k_cache = (__nv_bfloat16 *)r->k_cache, a.v_cache = (__nv_bfloat16 *)r->v_cache;
    a.H = r->n_heads, a.Hkv = r->n_kv_heads, a.hd = r->head_dim, a.attn_scaling = r->attn_scaling;
    if (p->rope) pd_k_skinny_mma_launch_e<PD_K_SM_ROPE>(a, p->pipe, p->loads, s);
    else if (p->glu) pd_k_skinny_mma_launch_e<PD_K_SM_GLU>(a, p->pipe, p->loads, s);
    else if (p->residual) pd_k_skinny_mma_launch_e<PD_K_SM_RESIDUAL>(a, p->pipe, p->loads, s);
    else if (p->rows == 32)
        p->pipe ? pd_k_skinny_mma_launch_t<2, true, PD_K_SM_PLAIN, PD_K_SM_LOADS>(a, s)
                : pd_k_skinny_mma_launch_t<2, false, PD_K_SM_PLAIN, PD_K_SM_LOADS>(a, s);
    else pd_k_skinny_mma_launch_e<PD_K_SM_PLAIN>(a, p->pipe, p->loads, s);
}
