// skinny.cu — row-streaming skinny GEMM for decode (M <= 8): out (M, N) = a (M, K) . w(N, K)^T,
// bound by streaming the weight once from HBM.
//
// One thread block of 128 threads owns R consecutive weight rows (R = 4 by default) and the whole
// K: thread t reads 16-byte chunks t, t + 128, ... of each of its rows (a warp reads 512
// contiguous bytes of a row per load), U = 16 / R chunks per row per batch, so every thread has 16
// independent 16-byte weight loads (256 bytes) in flight before it does any arithmetic. The loads
// are ld.global.nc.L1::no_allocate (read once: they would only evict the activations from L1).
// For K = 4096 one batch is the block's whole tile (R x 8 KB); grids of N / R blocks (1024 for
// N = 4096, 32064 for the lm_head) are scheduled dynamically, so the last wave is a few small
// blocks, not a partial wave of big ones — no split-K and no workspace.
// The M activation rows are read through L1 (__ldg; every block of an SM reads the same rows) and
// unpacked to f32 once per chunk for all R rows; f32 FMAs on CUDA cores (M x R accumulators per
// thread), then a recursive-halving warp reduction (31 shuffles for 32 sums, not 160) and a
// 4-warp reduction through shared memory; threads 0 .. R*M-1 add bias / the previous output and
// store.
// PDL: the first batch of weight loads is issued before pd_k_pdl_wait() (weights are never
// written by a kernel), so it overlaps the previous kernel's tail; so is a prefetch of the fused
// norm's weight (see "Norm prefetch").
#include "kernels/common.cuh"
#include "kernels/skinny.cuh"

#define PD_K_SK_THREADS 128
#define PD_K_SK_LOADS 16  // 16-byte weight loads in flight per thread (R rows x U chunks)

typedef struct pd_k_skinny_args {
    const __nv_bfloat16 *a, *w, *bias;
    const __nv_bfloat16 *norm_w;
    void *out;
    int M, N, K, lda, accumulate, out_f32, hf;
    float eps;
    // rope epilogue
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    __nv_bfloat16 *k_cache, *v_cache;
    int H, Hkv, hd;
    float attn_scaling;
    int prewait;  // batches of loads issued before the PDL wait (U or more: all)
    int norm_pf;  // the norm weight prefetched before the PDL wait: 0 no, 1 into L1, 2 into L2
} pd_k_skinny_args;

// Weight chunks c + u * 128 (u < U) of the R rows; chunks past the row's end read as zero.
template <int R, int U>
static __device__ __forceinline__ void pd_k_sk_load(uint4 (&wv)[U][R], const uint4 *const (&wr)[R], int c,
                                                    int chunks) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[u][r] = c + u * PD_K_SK_THREADS < chunks ? pd_k_ld_stream(wr[r] + c + u * PD_K_SK_THREADS)
                                                        : make_uint4(0, 0, 0, 0);
}

// The same chunks copied into shared memory with cp.async (slot (u R + r) 128 + tid; zero-filled
// past the row's end), one commit group.
template <int R, int U>
static __device__ __forceinline__ void pd_k_sk_load_async(uint4 *wsm, const uint4 *const (&wr)[R], int tid, int c,
                                                          int chunks) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            bool ok = c + u * PD_K_SK_THREADS < chunks;
            pd_k_cp_async16(&wsm[(u * R + r) * PD_K_SK_THREADS + tid], ok ? wr[r] + c + u * PD_K_SK_THREADS : wr[r], ok);
        }
    pd_k_cp_async_commit();
}

// Smallest power of two >= x (x <= 32).
#define PD_K_SK_P2(x) ((x) <= 1 ? 1 : (x) <= 2 ? 2 : (x) <= 4 ? 4 : (x) <= 8 ? 8 : (x) <= 16 ? 16 : 32)

// Sums each of the P values v[0..P-1] over the warp with P - 1 + log2(32 / P) shuffles instead of
// 5 P (recursive halving: at each step a lane keeps one half of its values, sends the other half
// to its partner and adds what it receives). Returns the index of the value whose sum the lane
// holds in v[0] (lane >> (5 - log2 P)), or -1 for the lanes that hold a duplicate.
template <int P>
static __device__ __forceinline__ int pd_k_sk_warp_reduce(float (&v)[P], int lane) {
    constexpr int lg = P >= 32 ? 5 : P >= 16 ? 4 : P >= 8 ? 3 : P >= 4 ? 2 : P >= 2 ? 1 : 0;
#pragma unroll
    for (int st = 0; st < lg; st++) {  // step st: partner lane ^ (16 >> st), P >> (st + 1) sums each way
        const int half = P >> (st + 1), off = 16 >> st;
        const bool up = lane & off;
#pragma unroll
        for (int i = 0; i < P / 2; i++)
            if (i < half) {
                float send = up ? v[i] : v[i + half], keep = up ? v[i + half] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
            }
    }
#pragma unroll
    for (int off = 16 >> lg; off >= 1; off /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
    return (lane & (32 / P - 1)) ? -1 : lane >> (5 - lg);
}

enum { PD_K_SK_PLAIN = 0, PD_K_SK_RESIDUAL = 1, PD_K_SK_GLU = 2, PD_K_SK_ROPE = 3 };

// NORM: the activation rows are RMS-normalised on the fly (each block recomputes the M sums of
// squares from the rows it reads anyway; they are in L1/L2 after the first block): a_k =
// bf16(g_k * bf16(x_k * inv)) as kernels/rmsnorm.cu stores them. EPI: PD_K_SK_PLAIN (bias,
// accumulate, f32 out), PD_K_SK_RESIDUAL (out = bf16(out + bf16(v + bias))) or PD_K_SK_GLU (the
// block's R rows are R/2 gate rows p.. and the matching up rows N + p..; out = bf16(bf16(silu(g)) *
// u) of the rounded halves, as silu_mul.cu computes it from the stored gate_up) or PD_K_SK_ROPE
// (the qkv GEMM: the first (H + Hkv) hd / 4 blocks own two rotation pairs each, rows i, i + 1,
// i + hd/2, i + hd/2 + 1 of one q / k head, and rotate them as rope_kv.cu does; the rest own 4
// consecutive v rows; k and v go to the cache slot of each token, skipped where the slot is < 0).
// Builds (VAR; minBlocks 0 = no bound: an explicit 1 let the compiler take ~20 more registers,
// 89 -> 110 at M = 1, one block fewer per SM): PD_K_SK_REG, the weights loaded into registers; PD_K_SK_OCC4, the same bounded to
// 128 registers (M = 5: 4 blocks of 32 KB of loads in flight per SM instead of 3 at its natural
// 130; no spills); PD_K_SK_ASYNC, the weights copied into shared memory with cp.async (each thread
// reads back only the 16-byte slots it copied, so no barrier): the 64 registers the loads held are
// free, and the blocks per SM are bounded by shared memory (32 KB each: 6) rather than registers
// (3 at M = 5, 2 at M = 8), so more bytes are in flight per SM at M >= 5.
enum { PD_K_SK_REG = 0, PD_K_SK_OCC4 = 1, PD_K_SK_ASYNC = 2 };
// Prewait (PD_CUDA_SKINNY_PREWAIT=u, a measurement knob): only the first u of the U batches of a
// block's weight loads are issued before the PDL wait, the rest right after it, before any
// arithmetic. Measured on an H100 (session 13, tools/gpu/NOTES.md dec13-2): u = 0 costs 170 us a
// single-stream step (the loads before the wait are worth that much), u = 2 is level.

// Tile vb's first weight row, whether it is a rotation tile (the rope form: rotation tiles own two
// pairs of one q / k head, i.e. rows i, i + 1, i + hd/2, i + hd/2 + 1; v tiles R consecutive rows)
// and its R weight row pointers (rows past N repeat the last row; their sums are not stored).
template <int R, int EPI>
static __device__ __forceinline__ void pd_k_sk_rows(const pd_k_skinny_args &p, int vb, int &row0, bool &rot,
                                                    const uint4 *(&wr)[R]) {
    row0 = vb * (EPI == PD_K_SK_GLU ? R / 2 : R);
    const int half = p.hd >> 1, rot_blocks = EPI == PD_K_SK_ROPE ? (p.H + p.Hkv) * half / 2 : 0;
    rot = EPI == PD_K_SK_ROPE && vb < rot_blocks;
    if (EPI == PD_K_SK_ROPE) {
        if (rot) {
            int pr = 2 * vb, h = pr / half;
            row0 = h * p.hd + (pr - h * half);
        } else {
            row0 = (p.H + p.Hkv) * p.hd + (vb - rot_blocks) * R;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        int n;
        if (EPI == PD_K_SK_GLU) n = min(row0 + r % (R / 2), p.N - 1) + (r / (R / 2)) * p.N;
        else if (EPI == PD_K_SK_ROPE && rot) n = row0 + r % (R / 2) + (r / (R / 2)) * half;
        else n = min(row0 + r, p.N - 1);
        wr[r] = (const uint4 *)(p.w + (size_t)n * p.K);
    }
}

// acc += the R weight chunks w (chunk cu of each row) times chunk cu of the M activation rows
// (normalised on the fly with NORM).
template <int M, int R, int NORM>
static __device__ __forceinline__ void pd_k_sk_fma(const pd_k_skinny_args &p, const uint4 (&w)[R], int cu,
                                                   const uint4 *const (&ar)[M], const float (&inv)[M], float (&acc)[R][M]) {
    float wf[R][8], gf[8];
    uint4 graw = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < R; r++) pd_k_unpack8(w[r], wf[r]);
    if (NORM) {
        graw = __ldg((const uint4 *)p.norm_w + cu);
        pd_k_unpack8(graw, gf);
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float af[8];
        pd_k_unpack8(__ldg(ar[m] + cu), af);
        if (NORM && p.hf) {  // bf16(g * bf16(x * inv)), two at a time: the bf16x2 product of
                             // two bf16 values is their exact product rounded once
            const uint32_t gw[4] = {graw.x, graw.y, graw.z, graw.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                __nv_bfloat162 nv = __floats2bfloat162_rn(af[2 * i] * inv[m], af[2 * i + 1] * inv[m]);
                __nv_bfloat162 pr = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&gw[i]), nv);
                uint32_t pw = *reinterpret_cast<uint32_t *>(&pr);
                af[2 * i] = __uint_as_float(pw << 16);
                af[2 * i + 1] = __uint_as_float(pw & 0xffff0000u);
            }
        } else if (NORM) {
#pragma unroll
            for (int j = 0; j < 8; j++) af[j] = pd_k_bf16r(gf[j] * (af[j] * inv[m]));
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[r][m] = fmaf(wf[r][j], af[j], acc[r][m]);
    }
}

// The tile's sums: the reduction over the block through red and the epilogue of the form.
template <int M, int R, int EPI>
static __device__ __forceinline__ void pd_k_sk_epi(const pd_k_skinny_args &p, const float (&acc)[R][M], int row0, bool rot,
                                                   float (*red)[R * M]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, half = p.hd >> 1;
    float v[PD_K_SK_P2(R * M)];
#pragma unroll
    for (int i = 0; i < PD_K_SK_P2(R * M); i++) v[i] = i < R * M ? acc[i / M][i % M] : 0.f;
    int idx = pd_k_sk_warp_reduce<PD_K_SK_P2(R * M)>(v, lane);
    if (idx >= 0 && idx < R * M) red[warp][idx] = v[0];
    __syncthreads();
    if (EPI == PD_K_SK_GLU) {
        if (tid < (R / 2) * M) {
            int r = tid / M, m = tid - r * M, n = row0 + r;
            if (n < p.N) {
                float g = 0.f, u = 0.f;
#pragma unroll
                for (int i = 0; i < PD_K_SK_THREADS / 32; i++) g += red[i][tid], u += red[i][tid + (R / 2) * M];
                if (p.bias) g += __bfloat162float(p.bias[n]), u += __bfloat162float(p.bias[p.N + n]);
                g = pd_k_bf16r(g), u = pd_k_bf16r(u);  // the stored gate_up
                float sg = pd_k_silu(g);
                ((__nv_bfloat16 *)p.out)[(size_t)m * p.N + n] = __float2bfloat16((p.hf ? pd_k_bf16r(sg) : sg) * u);
            }
        }
        return;
    }
    if (EPI == PD_K_SK_ROPE) {
        const size_t row = (size_t)(p.H + 2 * p.Hkv) * p.hd, kvw = (size_t)p.Hkv * p.hd;
        __nv_bfloat16 *qkv = (__nv_bfloat16 *)p.out;
        if (rot && tid < (R / 2) * M) {  // pair j of token m: rows row0 + j and row0 + j + hd/2
            int j = tid / M, m = tid - j * M, n0 = row0 + j, n1 = n0 + half, h = n0 / p.hd, i = n0 - h * p.hd;
            float x0 = 0.f, x1 = 0.f;
#pragma unroll
            for (int w = 0; w < PD_K_SK_THREADS / 32; w++) x0 += red[w][tid], x1 += red[w][tid + (R / 2) * M];
            if (p.bias) x0 += __bfloat162float(p.bias[n0]), x1 += __bfloat162float(p.bias[n1]);
            float y0, y1;  // from the stored (rounded) q / k, as rope_kv.cu reads them
            pd_k_rope_pair(pd_k_bf16r(x0), pd_k_bf16r(x1), (float)p.positions[m], p.inv_freq[i], p.attn_scaling, p.hf,
                           &y0, &y1);
            __nv_bfloat16 b0 = __float2bfloat16(y0), b1 = __float2bfloat16(y1);
            qkv[(size_t)m * row + n0] = b0;
            qkv[(size_t)m * row + n1] = b1;
            int slot = p.slot_mapping[m];
            if (h >= p.H && slot >= 0) {
                __nv_bfloat16 *kd = p.k_cache + (size_t)slot * kvw + (size_t)(h - p.H) * p.hd;
                kd[i] = b0;
                kd[i + half] = b1;
            }
        } else if (!rot && tid < R * M) {
            int r = tid / M, m = tid - r * M, n = row0 + r;
            if (n < p.N) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < PD_K_SK_THREADS / 32; w++) v += red[w][tid];
                if (p.bias) v += __bfloat162float(p.bias[n]);
                __nv_bfloat16 bv = __float2bfloat16(v);
                qkv[(size_t)m * row + n] = bv;
                int slot = p.slot_mapping[m];
                if (slot >= 0) p.v_cache[(size_t)slot * kvw + (size_t)(n - (p.H + p.Hkv) * p.hd)] = bv;
            }
        }
        return;
    }
    if (tid < R * M) {
        int r = tid / M, m = tid - r * M, n = row0 + r;
        if (n < p.N) {
            float v = 0.f;
#pragma unroll
            for (int i = 0; i < PD_K_SK_THREADS / 32; i++) v += red[i][tid];
            if (p.bias) v += __bfloat162float(p.bias[n]);
            size_t o = (size_t)m * p.N + n;
            if (EPI == PD_K_SK_RESIDUAL) pd_k_gemm_out_residual(p.out, o, v);
            else pd_k_gemm_out(p.out, o, v, p.out_f32, p.accumulate);
        }
    }
}

// Weight chunks c + u * 128 (U0 <= u < U1) of the R rows into wv[u]; chunks past the row's end read as zero.
template <int R, int U, int U0, int U1>
static __device__ __forceinline__ void pd_k_sk_load_part(uint4 (&wv)[U][R], const uint4 *const (&wr)[R], int c, int chunks) {
#pragma unroll
    for (int u = U0; u < U1; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[u][r] = c + u * PD_K_SK_THREADS < chunks ? pd_k_ld_stream(wr[r] + c + u * PD_K_SK_THREADS)
                                                        : make_uint4(0, 0, 0, 0);
}

// Norm prefetch (PD_CUDA_SKINNY_NORM_PF, kparams norm_pf; default 1): the norm weight's 16-byte
// chunks of a block's first load batch are prefetched into L1 (1; or L2, 2) before the PDL wait,
// like the GEMM weights. The norm weights are per layer (8 KB at K = 4096) and read once a step, so
// the whole step's streaming has evicted them from L2 by then: without the prefetch every
// first-wave block of the qkv and gate_up GEMMs (64 a step, and the lm_head's final norm) meets an
// HBM miss right after its release, between the sum of squares and its first FMA. Measured on an
// H100 (session 14, tools/gpu/NOTES.md dec14-2): op_bench single with per-layer norm weights 5230.4
// -> 5200.8 us (shared, always cached: 5184.2, level), bench-engine single stream ctx 128 5.263-5.269
// -> 5.206-5.228 ms; it is the ~50 us "engine vs replica" gap of sessions 12-13 (the replica shared
// one norm weight across layers).
static __device__ __forceinline__ void pd_k_sk_norm_prefetch(const pd_k_skinny_args &p, int tid, int chunks) {
#pragma unroll
    for (int u = 0; u < PD_K_SK_LOADS / 4; u++) {  // (U <= 4 batches of chunks tid + u * 128)
        int c = tid + u * PD_K_SK_THREADS;
        if (c < chunks && (c & 7) == 0) {  // one prefetch per 128-byte line
            const uint4 *a = (const uint4 *)p.norm_w + c;
            if (p.norm_pf == 1) asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a));
            else asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a));
        }
    }
}

template <int M, int R, int NORM, int EPI, int VAR>
static __global__ void __launch_bounds__(PD_K_SK_THREADS, VAR == PD_K_SK_OCC4 ? 4 : 0) k_skinny(pd_k_skinny_args p) {
    constexpr bool AS = VAR == PD_K_SK_ASYNC;
    constexpr int U = PD_K_SK_LOADS / R;
    pd_k_pdl_trigger();
    const int tid = threadIdx.x, chunks = p.K >> 3;
    int row0;
    bool rot;
    const uint4 *wr[R];
    pd_k_sk_rows<R, EPI>(p, blockIdx.x, row0, rot, wr);
    uint4 wv[AS ? 1 : U][AS ? 1 : R];
    __shared__ uint4 wsm[AS ? PD_K_SK_LOADS * PD_K_SK_THREADS : 1];  // slot (u R + r) 128 + tid
    if constexpr (AS) {
        pd_k_sk_load_async<R, U>(wsm, wr, tid, tid, chunks);
        pd_k_pdl_wait();  // the activations (and out) belong to earlier kernels
    } else if (p.prewait >= U) {
        pd_k_sk_load<R, U>(wv, wr, tid, chunks);
        if (NORM && p.norm_pf) pd_k_sk_norm_prefetch(p, tid, chunks);
        pd_k_pdl_wait();
    } else {  // the first p.prewait batches before the wait, the rest right after it
        if (p.prewait >= 1) pd_k_sk_load_part<R, U, 0, 1>(wv, wr, tid, chunks);
        if (p.prewait >= 2) pd_k_sk_load_part<R, U, 1, 2>(wv, wr, tid, chunks);
        if (p.prewait >= 3) pd_k_sk_load_part<R, U, 2, 3>(wv, wr, tid, chunks);
        pd_k_pdl_wait();
        if (p.prewait < 1) pd_k_sk_load_part<R, U, 0, 1>(wv, wr, tid, chunks);
        if (p.prewait < 2) pd_k_sk_load_part<R, U, 1, 2>(wv, wr, tid, chunks);
        if (p.prewait < 3) pd_k_sk_load_part<R, U, 2, 3>(wv, wr, tid, chunks);
        pd_k_sk_load_part<R, U, 3, U>(wv, wr, tid, chunks);
    }

    const uint4 *ar[M];
#pragma unroll
    for (int m = 0; m < M; m++) ar[m] = (const uint4 *)(p.a + (size_t)m * p.lda);
    const int lane = tid & 31, warp = tid >> 5;
    float inv[M];
#pragma unroll
    for (int m = 0; m < M; m++) inv[m] = 1.f;
    if (NORM) {
        __shared__ float ssr[PD_K_SK_THREADS / 32][M];
        float ss[M];
#pragma unroll
        for (int m = 0; m < M; m++) ss[m] = 0.f;
        for (int c = tid; c < chunks; c += PD_K_SK_THREADS)
#pragma unroll
            for (int m = 0; m < M; m++) {
                float af[8];
                pd_k_unpack8(__ldg(ar[m] + c), af);
#pragma unroll
                for (int j = 0; j < 8; j++) ss[m] = fmaf(af[j], af[j], ss[m]);
            }
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v = pd_k_warp_sum(ss[m]);
            if (lane == 0) ssr[warp][m] = v;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v = 0.f;
#pragma unroll
            for (int i = 0; i < PD_K_SK_THREADS / 32; i++) v += ssr[i][m];
            inv[m] = rsqrtf(v / (float)p.K + p.eps);
        }
    }
    __shared__ float red[PD_K_SK_THREADS / 32][R * M];
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;
    if constexpr (AS) pd_k_cp_async_wait<0>();
    constexpr int UNR = AS ? 1 : U;  // (unrolled, the shared-memory reads would all be hoisted into registers)
    for (int c = tid;;) {
#pragma unroll UNR
        for (int u = 0; u < U; u++) {
            int cu = c + u * PD_K_SK_THREADS;
            if (cu >= chunks) break;
            uint4 w[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                if constexpr (AS) w[r] = wsm[(u * R + r) * PD_K_SK_THREADS + tid];
                else w[r] = wv[u][r];
            }
            pd_k_sk_fma<M, R, NORM>(p, w, cu, ar, inv, acc);
        }
        c += U * PD_K_SK_THREADS;
        if (c >= chunks) break;
        if constexpr (AS) {
            pd_k_sk_load_async<R, U>(wsm, wr, tid, c, chunks);
            pd_k_cp_async_wait<0>();
        } else {
            pd_k_sk_load<R, U>(wv, wr, c, chunks);
        }
    }
    pd_k_sk_epi<M, R, EPI>(p, acc, row0, rot, red);
}

extern "C" int pd_cuda_skinny_supported(int M, int K, int lda, const void *a, const void *w) {
    return M >= 1 && M <= PD_SKINNY_MAX_M && K > 0 && K % 8 == 0 && lda % 8 == 0 && ((uintptr_t)a & 15) == 0 &&
           ((uintptr_t)w & 15) == 0;
}

template <int R, int NORM, int EPI, int VAR>
static void pd_k_skinny_launch_v(const pd_k_skinny_args &a, cudaStream_t s, dim3 grid, dim3 block) {
    switch (a.M) {
    case 1: pd_k_launch(k_skinny<1, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 2: pd_k_launch(k_skinny<2, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 3: pd_k_launch(k_skinny<3, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 4: pd_k_launch(k_skinny<4, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 5: pd_k_launch(k_skinny<5, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 6: pd_k_launch(k_skinny<6, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    case 7: pd_k_launch(k_skinny<7, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    default: pd_k_launch(k_skinny<8, R, NORM, EPI, VAR>, grid, block, 0, s, a); break;
    }
}

// var: PD_K_SK_REG, PD_K_SK_OCC4 (M = 5 only; other M take the register build) or PD_K_SK_ASYNC.
template <int R, int NORM, int EPI>
static void pd_k_skinny_launch_r(pd_k_skinny_args a, cudaStream_t s, int var) {
    int rows = EPI == PD_K_SK_GLU ? R / 2 : R;
    unsigned n_blocks = (unsigned)((a.N + rows - 1) / rows);
    if (EPI == PD_K_SK_ROPE)  // rotation blocks (2 pairs each), then v blocks
        n_blocks = (unsigned)((a.H + a.Hkv) * (a.hd / 2) / 2 + (a.Hkv * a.hd + R - 1) / R);
    dim3 grid(n_blocks), block(PD_K_SK_THREADS);
    if (var == PD_K_SK_ASYNC) {
        pd_k_skinny_launch_v<R, NORM, EPI, PD_K_SK_ASYNC>(a, s, grid, block);
    } else if (var == PD_K_SK_OCC4 && a.M == 5) {
        pd_k_launch(k_skinny<5, R, NORM, EPI, PD_K_SK_OCC4>, grid, block, 0, s, a);
    } else {
        pd_k_skinny_launch_v<R, NORM, EPI, PD_K_SK_REG>(a, s, grid, block);
    }
}

extern "C" void pd_cuda_skinny(const pd_skinny_kparams *p, cudaStream_t s) {
    pd_k_skinny_args a;
    a.a = (const __nv_bfloat16 *)p->a;
    a.w = (const __nv_bfloat16 *)p->w;
    a.bias = (const __nv_bfloat16 *)p->bias;
    a.norm_w = (const __nv_bfloat16 *)p->norm_w;
    a.out = p->out;
    a.M = p->M, a.N = p->N, a.K = p->K, a.lda = p->lda ? p->lda : p->K;
    a.accumulate = p->accumulate, a.out_f32 = p->out_f32;
    a.hf = pd_k_hf_rounding(), a.eps = p->norm_eps;
    const pd_skinny_rope *r = &p->rope_kv;
    a.positions = r->positions, a.slot_mapping = r->slot_mapping, a.inv_freq = r->inv_freq;
    a.k_cache = (__nv_bfloat16 *)r->k_cache, a.v_cache = (__nv_bfloat16 *)r->v_cache;
    a.H = r->n_heads, a.Hkv = r->n_kv_heads, a.hd = r->head_dim, a.attn_scaling = r->attn_scaling;
    const int var = p->async ? PD_K_SK_ASYNC : p->occ4 ? PD_K_SK_OCC4 : PD_K_SK_REG;
    a.prewait = p->prewait > 0 ? p->prewait - 1 : PD_K_SK_LOADS;  // (kparams: 0 = all, u + 1 = u batches)
    a.norm_pf = p->norm_pf;
    if (p->rope) {  // the qkv GEMM: with the attention norm (decode) or without
        if (p->norm_w) pd_k_skinny_launch_r<4, 1, PD_K_SK_ROPE>(a, s, var);
        else pd_k_skinny_launch_r<4, 0, PD_K_SK_ROPE>(a, s, var);
        return;
    }
    // The fused forms: 4 rows per block (2 gate/up pairs with glu); only the instantiations the
    // decode step uses (norm with plain (lm_head) or glu (gate_up) or plain (qkv); residual alone).
    if (p->norm_w && p->glu) pd_k_skinny_launch_r<4, 1, PD_K_SK_GLU>(a, s, var);
    else if (p->norm_w && !p->residual) pd_k_skinny_launch_r<4, 1, PD_K_SK_PLAIN>(a, s, var);
    else if (p->norm_w) pd_k_skinny_launch_r<4, 1, PD_K_SK_RESIDUAL>(a, s, var);
    else if (p->glu) pd_k_skinny_launch_r<4, 0, PD_K_SK_GLU>(a, s, var);
    else if (p->residual) pd_k_skinny_launch_r<4, 0, PD_K_SK_RESIDUAL>(a, s, var);
    else if (p->rows == 2) pd_k_skinny_launch_r<2, 0, PD_K_SK_PLAIN>(a, s, var);
    else pd_k_skinny_launch_r<4, 0, PD_K_SK_PLAIN>(a, s, var);
}
