// gemv.cu — skinny GEMM for decode (M <= 16): out (M, N) = a (M, K) . w(N, K)^T, bound by the
// bandwidth of streaming the weight once. Tensor cores do the arithmetic (mma m16n8k16, the M
// rows padded to 16), so M = 16 costs about what M = 1 costs.
//
// Work split (stream-K): the weight is cut into units of 8 rows x 64 k (1 KB). Units are numbered
// tile-major (unit = tile * Kc + chunk, tile = 8 output columns, Kc = ceil(K / 64)) and every warp
// of a grid sized to fill the GPU once (SMs x resident CTAs) takes one contiguous run of
// ceil(total / warps) units. All SMs stream the same number of bytes whatever N is, so there is no
// partial last wave and no separate split-K pass. A warp that covers a whole tile writes its
// outputs directly; otherwise it adds its partial sums into an f32 workspace with atomics and
// bumps the tile's counter by the chunks it covered; the warp that completes the count (the
// last) writes the outputs and zeroes the workspace rows and the counter for the next launch.
//
// Loads: lane (g = lane/4, t = lane%4) fetches 8 consecutive k of weight row g (16 bytes; 4 lanes
// read 64 contiguous bytes of a row) for k = chunk*64 + h*32 + t*8, h = 0, 1, and the same k of
// activation rows g (and g+8). A dot product does not care about the order of k, and A and B agree
// on the permutation, so these registers feed mma k16 steps as if they were the standard
// fragments. Weights stream through a per-warp ring of S cp.async stages of U units (U KB) in
// shared memory, S - 1 stages in flight while one is consumed (~100+ KB per SM in flight, no
// registers held); activations are read through L1 (every warp of an SM reads the same rows).
//
// PDL: the first S - 1 stages of weight copies are issued before pd_k_pdl_wait(): they do not
// depend on the previous kernel, so they overlap its tail.
#include "kernels/common.cuh"
#include "kernels/gemv.cuh"

#define PD_K_GEMV_WARPS 4
#define PD_K_GEMV_STAGES 4  // cp.async stages per warp: 3 in flight while one is consumed
#define PD_K_GEMV_MIN_UPW 8  // units per warp at least (fewer, busier warps for small shapes)
#define PD_K_GEMV_WS_ROWS 16

typedef struct pd_k_gemv_args {
    const __nv_bfloat16 *a, *w, *bias;
    void *out;
    float *ws;  // (T, 16, 8) f32 partial sums
    int *cnt;   // (T) chunks accumulated so far
    int M, N, K, lda, Kc, total, upw, accumulate, out_f32;
} pd_k_gemv_args;

static __device__ __forceinline__ void pd_k_gemv_store(const pd_k_gemv_args &p, int m, int col, float v) {
    if (p.bias) v += __bfloat162float(p.bias[col]);
    pd_k_gemm_out(p.out, (size_t)m * p.N + col, v, p.out_f32, p.accumulate);
}

// Writes (whole tile) or accumulates (partial) the warp's sums for chunks [first, end) of tile.
// c[0..1]: row g, columns 2t, 2t+1 of the tile; c[2..3]: row g + 8.
template <int MT>
static __device__ __forceinline__ void pd_k_gemv_flush(const pd_k_gemv_args &p, int tile, int first, int end,
                                                       const float c[4], int lane) {
    int g = lane >> 2, t = lane & 3;
    if (first == 0 && end == p.Kc) {
#pragma unroll
        for (int i = 0; i < 2 * MT; i++) {
            int m = g + (i >= 2 ? 8 : 0), col = tile * 8 + 2 * t + (i & 1);
            if (m < p.M && col < p.N) pd_k_gemv_store(p, m, col, c[i]);
        }
        return;
    }
    float *ws = p.ws + (size_t)tile * PD_K_GEMV_WS_ROWS * 8;
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        int m = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        if (m < p.M && tile * 8 + col < p.N) atomicAdd(ws + m * 8 + col, c[i]);
    }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(p.cnt + tile, end - first) + (end - first) == p.Kc;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        int m = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        if (m < p.M && tile * 8 + col < p.N) {
            float v = __ldcg(ws + m * 8 + col);
            __stcg(ws + m * 8 + col, 0.0f);
            pd_k_gemv_store(p, m, tile * 8 + col, v);
        }
    }
    if (lane == 0) atomicExch(p.cnt + tile, 0);
}

// Stage i of a warp: units u0 + i*U .. + U (one tile: U divides Kc and u0), weights only.
// Lane (g, t) copies its 16-byte pieces (unit j, half h) into its own slots buf[j*2 + h][lane],
// so it later reads back exactly what it wrote: no barrier, no bank conflicts.
template <int U>
static __device__ __forceinline__ void pd_k_gemv_issue(const pd_k_gemv_args &p, uint4 (*buf)[32], int u, bool live,
                                                       int lane) {
    if (live) {
        int g = lane >> 2, t = lane & 3, tile = u / p.Kc, chunk = u - tile * p.Kc, n = tile * 8 + g;
        const __nv_bfloat16 *wr = p.w + (size_t)(n < p.N ? n : 0) * p.K;
#pragma unroll
        for (int j = 0; j < U; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int k = (chunk + j) * 64 + h * 32 + t * 8;
                bool ok = n < p.N && k < p.K;
                pd_k_cp_async16(&buf[j * 2 + h][lane], ok ? wr + k : p.w, ok);
            }
    }
    pd_k_cp_async_commit();  // empty groups keep the wait counts uniform
}

// ---- the consuming side, shared by both kernels ------------------------------------------------

// Moves a warp's run on to unit u: when u starts a new tile, the previous tile's sums are flushed.
// Returns u's chunk within its tile; [first, end) tracks the chunks summed into c so far.
template <int MT, int U>
static __device__ __forceinline__ int pd_k_gemv_next(const pd_k_gemv_args &p, int u, float (*c)[4], int &tile,
                                                     int &first, int &end, int lane) {
    int ti = u / p.Kc, chunk = u - ti * p.Kc;
    if (ti != tile) {  // the previous tile's run ended at its last chunk
        float cs[4] = {c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]};
        pd_k_gemv_flush<MT>(p, tile, first, end, cs, lane);
#pragma unroll
        for (int r = 0; r < 4; r++) c[0][r] = c[1][r] = 0.f;
        tile = ti, first = chunk;
    }
    end = chunk + U;
    return chunk;
}

// Activation fragments of U units from `chunk` (rows g and g + 8) times the weight fragments wv,
// accumulated into two mma chains (h = 0, 1). CHECK_K: K is not a multiple of the stage.
template <int MT, int U, bool CHECK_K>
static __device__ __forceinline__ void pd_k_gemv_mma(const pd_k_gemv_args &p, const __nv_bfloat16 *ar0,
                                                     const __nv_bfloat16 *ar1, int chunk, const uint4 (*wv)[2],
                                                     float (*c)[4], int lane) {
    int g = lane >> 2, t = lane & 3;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < U; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int k = (chunk + j) * 64 + h * 32 + t * 8;
            bool ok = !CHECK_K || k < p.K;
            uint4 av = (ok && g < p.M) ? __ldg((const uint4 *)(ar0 + k)) : zero;
            uint4 bv = (MT == 2 && ok && g + 8 < p.M) ? __ldg((const uint4 *)(ar1 + k)) : zero;
            uint32_t fa[4] = {av.x, bv.x, av.y, bv.y};
            pd_k_mma_bf16(c[h], fa, wv[j][h].x, wv[j][h].y);
            uint32_t fb[4] = {av.z, bv.z, av.w, bv.w};
            pd_k_mma_bf16(c[h], fb, wv[j][h].z, wv[j][h].w);
        }
}

template <int MT, int U, int S>
static __global__ void __launch_bounds__(PD_K_GEMV_WARPS * 32) k_gemv(pd_k_gemv_args p) {
    extern __shared__ uint4 pd_k_gemv_smem[];  // [warps][S][U * 2][32]
    pd_k_pdl_trigger();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    int gw = blockIdx.x * PD_K_GEMV_WARPS + warp;
    int u0 = gw * p.upw, n_st = (min(p.total, u0 + p.upw) - u0) / U;
    if (n_st <= 0) {
        pd_k_pdl_wait();
        return;
    }
    uint4(*buf)[U * 2][32] = (uint4(*)[U * 2][32])(pd_k_gemv_smem + (size_t)warp * S * U * 2 * 32);
#pragma unroll
    for (int i = 0; i < S - 1; i++) pd_k_gemv_issue<U>(p, buf[i], u0 + i * U, i < n_st, lane);
    pd_k_pdl_wait();  // the activations (and out, ws) belong to earlier kernels

    const __nv_bfloat16 *ar0 = p.a + (size_t)(g < p.M ? g : 0) * p.lda;
    const __nv_bfloat16 *ar1 = p.a + (size_t)(g + 8 < p.M ? g + 8 : 0) * p.lda;
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // two mma chains (h = 0, 1)
    int tile = u0 / p.Kc, first = u0 - tile * p.Kc, end = first;
    for (int i = 0; i < n_st; i++) {
        pd_k_cp_async_wait<S - 2>();  // stage i has landed (this lane's own copies)
        pd_k_gemv_issue<U>(p, buf[(i + S - 1) % S], u0 + (i + S - 1) * U, i + S - 1 < n_st, lane);
        int chunk = pd_k_gemv_next<MT, U>(p, u0 + i * U, c, tile, first, end, lane);
        const uint4(*st)[32] = buf[i % S];
        uint4 wv[U][2];
#pragma unroll
        for (int j = 0; j < U; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) wv[j][h] = st[j * 2 + h][lane];
        pd_k_gemv_mma<MT, U, true>(p, ar0, ar1, chunk, wv, c, lane);
    }
    pd_k_cp_async_wait<0>();
    float cs[4] = {c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]};
    pd_k_gemv_flush<MT>(p, tile, first, end, cs, lane);
}

// ---- bulk-copy (TMA) variant: K % (64 * U) == 0 -----------------------------------------------
//
// Same units, stages and flushes as k_gemv, but a stage is 8 one-dimensional bulk copies (one per
// weight row: U * 128 contiguous bytes) issued by 8 lanes and completed on a per-stage mbarrier,
// instead of 8 warp-wide 16-byte cp.async: far fewer memory instructions per byte, which is what
// limits the cp.async kernel (~3.3 TB/s on an H200 against ~4.1 for cuBLASLt). Stage layout: row g
// at g * U * 128 bytes; lane (g, t) reads its 16-byte pieces at j*128 + h*64 + t*16 (a 2-way bank
// conflict between rows g and g^1, far below the shared-memory bandwidth at this byte rate).

static __device__ __forceinline__ void pd_k_mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(pd_k_smem_u32(bar)), "r"(count) : "memory");
}
static __device__ __forceinline__ void pd_k_mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(pd_k_smem_u32(bar)), "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void pd_k_mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(pd_k_smem_u32(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
static __device__ __forceinline__ void pd_k_bulk_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     pd_k_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(pd_k_smem_u32(bar))
                 : "memory");
}

// Stage for units u .. u + U of one tile: lane 0 arms the barrier, lanes 4g copy row g.
template <int U>
static __device__ __forceinline__ void pd_k_gemv_issue_tma(const pd_k_gemv_args &p, unsigned char *stage,
                                                           uint64_t *bar, int u, int lane) {
    int tile = u / p.Kc, chunk = u - tile * p.Kc;
    int rows = min(8, p.N - tile * 8);
    if (lane == 0) pd_k_mbar_expect_tx(bar, (uint32_t)rows * U * 128);
    __syncwarp();
    int g = lane >> 2;
    if ((lane & 3) == 0 && g < rows)
        pd_k_bulk_g2s(stage + g * U * 128, p.w + (size_t)(tile * 8 + g) * p.K + (size_t)chunk * 64, U * 128, bar);
}

template <int MT, int U, int S>
static __global__ void __launch_bounds__(PD_K_GEMV_WARPS * 32) k_gemv_tma(pd_k_gemv_args p) {
    extern __shared__ __align__(128) unsigned char pd_k_gemv_tsmem[];  // [warps][S][8][U * 128] | bars
    constexpr int STAGE = 8 * U * 128;
    pd_k_pdl_trigger();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int gw = blockIdx.x * PD_K_GEMV_WARPS + warp;
    int u0 = gw * p.upw, n_st = (min(p.total, u0 + p.upw) - u0) / U;
    if (n_st <= 0) {
        pd_k_pdl_wait();
        return;
    }
    unsigned char *ring = pd_k_gemv_tsmem + (size_t)warp * S * STAGE;
    uint64_t *bars = (uint64_t *)(pd_k_gemv_tsmem + (size_t)PD_K_GEMV_WARPS * S * STAGE) + warp * S;
    if (lane == 0) {
        for (int i = 0; i < S; i++) pd_k_mbar_init(bars + i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < S; i++)
        if (i < n_st) pd_k_gemv_issue_tma<U>(p, ring + i * STAGE, bars + i, u0 + i * U, lane);
    pd_k_pdl_wait();  // the activations (and out, ws) belong to earlier kernels

    const __nv_bfloat16 *ar0 = p.a + (size_t)(g < p.M ? g : 0) * p.lda;
    const __nv_bfloat16 *ar1 = p.a + (size_t)(g + 8 < p.M ? g + 8 : 0) * p.lda;
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int tile = u0 / p.Kc, first = u0 - tile * p.Kc, end = first;
    for (int i = 0; i < n_st; i++) {
        int chunk = pd_k_gemv_next<MT, U>(p, u0 + i * U, c, tile, first, end, lane);
        int sl = i % S;
        pd_k_mbar_wait(bars + sl, (uint32_t)(i / S) & 1u);
        const unsigned char *st = ring + sl * STAGE + g * U * 128 + t * 16;
        uint4 wv[U][2];
#pragma unroll
        for (int j = 0; j < U; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) wv[j][h] = *(const uint4 *)(st + j * 128 + h * 64);
        pd_k_gemv_mma<MT, U, false>(p, ar0, ar1, chunk, wv, c, lane);
        // every lane has read slot sl (the values went into the mma above): refill it with stage i + S
        __syncwarp();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (i + S < n_st) pd_k_gemv_issue_tma<U>(p, ring + sl * STAGE, bars + sl, u0 + (i + S) * U, lane);
    }
    float cs[4] = {c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]};
    pd_k_gemv_flush<MT>(p, tile, first, end, cs, lane);
}

extern "C" int pd_cuda_gemv_supported(int M, int K, int lda) { return M >= 1 && M <= 16 && K % 8 == 0 && lda % 8 == 0; }

extern "C" size_t pd_cuda_gemv_workspace_bytes(int N) {
    size_t T = (size_t)(N + 7) / 8;
    return T * PD_K_GEMV_WS_ROWS * 8 * sizeof(float) + T * sizeof(int);
}


// Grid: every resident CTA slot once; units per warp rounded to whole stages.
template <int U>
static void pd_k_gemv_launch(void (*kern)(pd_k_gemv_args), size_t smem, int *occ, pd_k_gemv_args &a, cudaStream_t s) {
    if (!*occ) {  // resident CTAs per SM (same on every device of one build's arch)
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        int o = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kern, PD_K_GEMV_WARPS * 32, smem);
        *occ = o > 0 ? o : 1;
    }
    long warps = (long)pd_k_num_sms() * *occ * PD_K_GEMV_WARPS;
    long upw = ((long)a.total + warps - 1) / warps;
    if (upw < PD_K_GEMV_MIN_UPW) upw = PD_K_GEMV_MIN_UPW;
    upw = (upw + U - 1) / U * U;  // whole stages; with U | Kc a stage never spans two tiles
    a.upw = (int)upw;
    long n_warps = ((long)a.total + upw - 1) / upw;
    int grid = (int)((n_warps + PD_K_GEMV_WARPS - 1) / PD_K_GEMV_WARPS);
    pd_k_launch(kern, dim3(grid), dim3(PD_K_GEMV_WARPS * 32), smem, s, a);
}

template <int MT, int U>
static void pd_k_gemv_launch_async(pd_k_gemv_args &a, cudaStream_t s) {
    static int occ = 0;
    const int S = PD_K_GEMV_STAGES;
    pd_k_gemv_launch<U>(k_gemv<MT, U, S>, (size_t)PD_K_GEMV_WARPS * S * U * 2 * 32 * sizeof(uint4), &occ, a, s);
}

template <int MT, int U>
static void pd_k_gemv_launch_tma(pd_k_gemv_args &a, cudaStream_t s) {
    static int occ = 0;
    const int S = PD_K_GEMV_STAGES;
    size_t smem = (size_t)PD_K_GEMV_WARPS * S * (8 * U * 128 + sizeof(uint64_t));
    pd_k_gemv_launch<U>(k_gemv_tma<MT, U, S>, smem, &occ, a, s);
}

// PD_CUDA_GEMV_TMA=0 selects the cp.async kernel for every shape (measurement knob).
static bool pd_k_gemv_tma_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_GEMV_TMA", &on);
}

extern "C" void pd_cuda_gemv(const pd_gemv_kparams *p, cudaStream_t s) {
    int T = (p->N + 7) / 8, Kc = (p->K + 63) / 64;
    pd_k_gemv_args a;
    a.a = (const __nv_bfloat16 *)p->a;
    a.w = (const __nv_bfloat16 *)p->w;
    a.bias = (const __nv_bfloat16 *)p->bias;
    a.out = p->out;
    a.ws = (float *)p->workspace;
    a.cnt = (int *)((char *)p->workspace + (size_t)T * PD_K_GEMV_WS_ROWS * 8 * sizeof(float));
    a.M = p->M, a.N = p->N, a.K = p->K, a.lda = p->lda ? p->lda : p->K;
    a.Kc = Kc, a.total = T * Kc, a.upw = 0, a.accumulate = p->accumulate, a.out_f32 = p->out_f32;
    // 4 units (4 KB of weight) per stage where 256 divides K (bulk copies), else the cp.async
    // kernel with 1 unit per stage (odd K: tests, small models)
    if (p->K % 256 == 0 && pd_k_gemv_tma_enabled()) {
        if (p->M <= 8) pd_k_gemv_launch_tma<1, 4>(a, s);
        else pd_k_gemv_launch_tma<2, 4>(a, s);
    } else if (p->K % 256 == 0) {
        if (p->M <= 8) pd_k_gemv_launch_async<1, 4>(a, s);
        else pd_k_gemv_launch_async<2, 4>(a, s);
    } else {
        if (p->M <= 8) pd_k_gemv_launch_async<1, 1>(a, s);
        else pd_k_gemv_launch_async<2, 1>(a, s);
    }
}
