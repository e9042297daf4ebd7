// bgemm.cu — batched-decode GEMM (17 <= M <= 64): out (M, N) = a (M, K) . w(N, K)^T, bound by
// streaming the weight once from HBM, with the SwiGLU of gate_up folded into its epilogue (glu).
//
// Why: at batch 24-64 a decode step is still a weight stream (64 flops per weight byte at M = 64),
// but cuBLASLt's kernels do not start loading before the previous kernel ends (no PDL), and the
// SwiGLU needs its own kernel and a round trip of the (M, 2F) gate_up output. Here:
//   * a 256-thread block owns 128 weight rows (with glu: 64 gate rows and the 64 matching up rows)
//     x all M rows (padded to 64 with zeros) over a k-range; tensor cores (mma.sync m16n8k16 bf16
//     -> f32), the weight rows as the MMA's m side (warp w: rows 16 w .. 16 w + 15) and the
//     activation rows its n side (8 tiles of 8);
//   * k runs through a 4-stage cp.async ring of 64-k slices in shared memory (16 KB of weight + 8
//     KB of activations a stage, 128-byte rows XOR-swizzled by 16-byte chunk so that ldmatrix is
//     conflict-free; PD_CUDA_BGEMM_STAGES=8: 8 stages, one block per SM); the first 3 stages' weight
//     copies are issued before the PDL wait (weights are never written by a kernel), so they
//     overlap the previous kernel's tail;
//   * split-K when the weight has too few 128-row tiles to fill the card (o, down, qkv at 8B
//     shapes): splits = floor(2 x SMs / tiles) blocks per tile (2 blocks fit on an SM;
//     PD_CUDA_BGEMM_PER_SM=1 sizes for one), each
//     writes its f32 partial tile to the scratch (no atomics: deterministic), the last block of a
//     tile (a counter per tile, reset by that block) adds the partials in split order and runs the
//     epilogue;
//   * epilogue: through shared memory, so that consecutive threads store consecutive columns: + bias,
//     + out (accumulate), bf16 or f32; glu: g, u rounded to bf16 (the stored gate_up of the unfused
//     sequence), out = bf16(bf16(silu(g)) * u) as silu_mul.cu computes it; rope (qkv, head_dim 128:
//     a tile is one head): q and k rotated from their rounded values as rope_kv.cu does, k and v
//     written to the bf16 cache, so no rope_kv kernel follows.
// Numerics: f32 accumulation over k in a different order than cuBLASLt (within the GEMM's rounding).
#include "kernels/bgemm.cuh"
#include "kernels/common.cuh"

#define BG_THREADS 256
#define BG_BW 128  // weight rows per block
#define BG_BM 64   // activation rows (M padded)
#define BG_BK 64   // k per stage (128-byte rows)
#define BG_MIN_KT 4  // k-slices per block at least (split-K sizing)
#define BG_W_BYTES (BG_BW * BG_BK * 2)
#define BG_A_BYTES (BG_BM * BG_BK * 2)
#define BG_STAGE_BYTES (BG_W_BYTES + BG_A_BYTES)
// ST stages: 4 (96 KB of shared memory: two blocks per SM) or 8 (192 KB: one block per SM, 7
// slices of weight in flight instead of 2 x 3)
#define BG_RED_LD (BG_BM + 1)                  // f32 tile [BG_BW][BG_RED_LD] in the epilogue
#define BG_TILE_F32 (BG_BW * BG_BM)            // one partial tile in the scratch
#define BG_CNT_BYTES 4096                      // the scratch starts with the tile counters (splits > 1:
                                               // tiles <= one wave / 2 < 1024), then the partials

typedef struct bg_args {
    const __nv_bfloat16 *a, *w, *bias;
    void *out;
    float *part;  // (splits, tiles, BG_BM, BG_BW) f32 partial tiles
    int *cnt;     // (tiles) blocks of the tile done so far
    int M, N, K, lda, accumulate, out_f32, glu, hf, tiles, splits, kt_per;
    int rope, H, Hkv;  // rope: tile h is head h (q heads, k heads, v heads)
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    __nv_bfloat16 *k_cache, *v_cache;
    float attn_scaling;
} bg_args;

static __device__ __forceinline__ uint32_t bg_swz(int row, int ch) { return (uint32_t)(row * 128 + ((ch ^ (row & 7)) << 4)); }

// Weight row of local row r of tile t (N_w rows; rows past the end load zeros).
static __device__ __forceinline__ int bg_wrow(const bg_args &p, int t, int r) {
    if (!p.glu) return t * BG_BW + r;
    return r < BG_BW / 2 ? t * (BG_BW / 2) + r : p.N + t * (BG_BW / 2) + (r - BG_BW / 2);
}

static __device__ __forceinline__ void bg_load_w(const bg_args &p, char *ws, int t, int kt, int tid) {
    int n_w = p.glu ? 2 * p.N : p.N;
#pragma unroll
    for (int i = 0; i < (BG_BW * 8) / BG_THREADS; i++) {
        int idx = tid + i * BG_THREADS, r = idx >> 3, ch = idx & 7, wr = bg_wrow(p, t, r);
        bool ok = wr < n_w;
        const __nv_bfloat16 *src = p.w + (size_t)(ok ? wr : 0) * p.K + (size_t)kt * BG_BK + ch * 8;
        pd_k_cp_async16(ws + bg_swz(r, ch), src, ok);
    }
}

static __device__ __forceinline__ void bg_load_a(const bg_args &p, char *as, int kt, int tid) {
#pragma unroll
    for (int i = 0; i < (BG_BM * 8) / BG_THREADS; i++) {
        int idx = tid + i * BG_THREADS, r = idx >> 3, ch = idx & 7;
        bool ok = r < p.M;
        const __nv_bfloat16 *src = p.a + (size_t)(ok ? r : 0) * p.lda + (size_t)kt * BG_BK + ch * 8;
        pd_k_cp_async16(as + bg_swz(r, ch), src, ok);
    }
}

template <int ST>
static __global__ void __launch_bounds__(BG_THREADS, ST <= 4 ? 2 : 1) k_bgemm(bg_args p) {
    extern __shared__ __align__(128) char smem[];
    pd_k_pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x, split = blockIdx.y;
    const int kt_total = p.K / BG_BK, kt0 = split * p.kt_per, kt1 = min(kt0 + p.kt_per, kt_total), nk = kt1 - kt0;
    // Weights of the first stages before the wait; one commit group per stage.
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) bg_load_w(p, smem + s * BG_STAGE_BYTES, tile, kt0 + s, tid);
        pd_k_cp_async_commit();
    }
    pd_k_pdl_wait();  // activations and out belong to earlier kernels
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) bg_load_a(p, smem + s * BG_STAGE_BYTES + BG_W_BYTES, kt0 + s, tid);
        pd_k_cp_async_commit();
    }
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
    const int q = lane >> 3, r8 = lane & 7;
    for (int i = 0; i < nk; i++) {
        // Groups so far: 2 (STAGES - 1) + i; stage i's weights and activations are in the oldest
        // 2 (STAGES - 1) + i - (STAGES - 2) groups.
        pd_k_cp_async_wait<ST - 2>();
        __syncthreads();
        {  // refill the stage consumed in the previous iteration
            int s = i + ST - 1;
            char *st = smem + (s % ST) * BG_STAGE_BYTES;
            if (s < nk) {
                bg_load_w(p, st, tile, kt0 + s, tid);
                bg_load_a(p, st + BG_W_BYTES, kt0 + s, tid);
            }
            pd_k_cp_async_commit();
        }
        const char *ws = smem + (i % ST) * BG_STAGE_BYTES, *as = ws + BG_W_BYTES;
#pragma unroll
        for (int kk = 0; kk < BG_BK / 16; kk++) {
            uint32_t af[4];
            {
                int row = 16 * warp + (q & 1) * 8 + r8, ch = 2 * kk + (q >> 1);
                pd_k_ldmatrix_x4(af, ws + bg_swz(row, ch));
            }
#pragma unroll
            for (int jp = 0; jp < 4; jp++) {
                uint32_t bf[4];
                int row = 16 * jp + (q >> 1) * 8 + r8, ch = 2 * kk + (q & 1);
                pd_k_ldmatrix_x4(bf, as + bg_swz(row, ch));
                pd_k_mma_bf16(acc[2 * jp], af, bf[0], bf[1]);
                pd_k_mma_bf16(acc[2 * jp + 1], af, bf[2], bf[3]);
            }
        }
    }
    pd_k_cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it becomes the f32 tile
    float *red = (float *)smem;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) red[(16 * warp + g + 8 * (e >> 1)) * BG_RED_LD + 8 * j + 2 * t4 + (e & 1)] = acc[j][e];
    __syncthreads();
    const int M = p.M;
    if (p.splits > 1) {
        float *mine = p.part + ((size_t)split * p.tiles + tile) * BG_TILE_F32;
        for (int idx = tid; idx < BG_BW * M; idx += BG_THREADS) {
            int m = idx / BG_BW, r = idx - m * BG_BW;
            __stcg(mine + m * BG_BW + r, red[r * BG_RED_LD + m]);
        }
        __threadfence();
        __syncthreads();
        __shared__ int s_last;
        if (tid == 0) s_last = atomicAdd(p.cnt + tile, 1) == p.splits - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        // every element of the thread (<= 32) loaded at once per split: one L2 latency per split
        constexpr int U = BG_BW * BG_BM / BG_THREADS;
        float v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = 0.f;
        for (int s = 0; s < p.splits; s++) {
            const float *src = p.part + ((size_t)s * p.tiles + tile) * BG_TILE_F32;
#pragma unroll
            for (int u = 0; u < U; u++) {
                int idx = tid + u * BG_THREADS;
                if (idx < BG_BW * M) v[u] += __ldcg(src + idx);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int idx = tid + u * BG_THREADS, m = idx / BG_BW, r = idx - m * BG_BW;
            if (idx < BG_BW * M) red[r * BG_RED_LD + m] = v[u];
        }
        if (tid == 0) p.cnt[tile] = 0;  // ready for the next launch
        __syncthreads();
    }
    if (p.rope) {  // one head per tile (head_dim == BG_BW); q, k rotated from their stored (rounded) values
        const int half = BG_BW / 2, h = tile;
        const size_t row = (size_t)p.N, kvw = (size_t)p.Hkv * BG_BW;
        __nv_bfloat16 *qkv = (__nv_bfloat16 *)p.out;
        if (h < p.H + p.Hkv) {
            for (int idx = tid; idx < half * M; idx += BG_THREADS) {
                int m = idx / half, i = idx - m * half, n0 = h * BG_BW + i, n1 = n0 + half;
                float x0 = red[i * BG_RED_LD + m], x1 = red[(i + half) * BG_RED_LD + m];
                if (p.bias) x0 += __bfloat162float(p.bias[n0]), x1 += __bfloat162float(p.bias[n1]);
                float y0, y1;
                pd_k_rope_pair(pd_k_bf16r(x0), pd_k_bf16r(x1), (float)p.positions[m], p.inv_freq[i], p.attn_scaling, p.hf,
                               &y0, &y1);
                __nv_bfloat16 b0 = __float2bfloat16(y0), b1 = __float2bfloat16(y1);
                qkv[(size_t)m * row + n0] = b0;
                qkv[(size_t)m * row + n1] = b1;
                int slot = p.slot_mapping[m];
                if (h >= p.H && slot >= 0) {
                    __nv_bfloat16 *kd = p.k_cache + (size_t)slot * kvw + (size_t)(h - p.H) * BG_BW;
                    kd[i] = b0;
                    kd[i + half] = b1;
                }
            }
        } else {
            for (int idx = tid; idx < BG_BW * M; idx += BG_THREADS) {
                int m = idx / BG_BW, r = idx - m * BG_BW, n = h * BG_BW + r;
                float v = red[r * BG_RED_LD + m];
                if (p.bias) v += __bfloat162float(p.bias[n]);
                __nv_bfloat16 bv = __float2bfloat16(v);
                qkv[(size_t)m * row + n] = bv;
                int slot = p.slot_mapping[m];
                if (slot >= 0) p.v_cache[(size_t)slot * kvw + (size_t)(h - p.H - p.Hkv) * BG_BW + r] = bv;
            }
        }
        return;
    }
    if (p.glu) {
        const int half = BG_BW / 2;
        for (int idx = tid; idx < half * M; idx += BG_THREADS) {
            int m = idx / half, c = idx - m * half, n = tile * half + c;
            if (n >= p.N) continue;
            float gv = red[c * BG_RED_LD + m], uv = red[(half + c) * BG_RED_LD + m];
            if (p.bias) gv += __bfloat162float(p.bias[n]), uv += __bfloat162float(p.bias[p.N + n]);
            gv = pd_k_bf16r(gv), uv = pd_k_bf16r(uv);  // the stored gate_up
            float sg = pd_k_silu(gv);
            ((__nv_bfloat16 *)p.out)[(size_t)m * p.N + n] = __float2bfloat16((p.hf ? pd_k_bf16r(sg) : sg) * uv);
        }
        return;
    }
    for (int idx = tid; idx < BG_BW * M; idx += BG_THREADS) {
        int m = idx / BG_BW, r = idx - m * BG_BW, n = tile * BG_BW + r;
        if (n >= p.N) continue;
        float v = red[r * BG_RED_LD + m];
        if (p.bias) v += __bfloat162float(p.bias[n]);
        pd_k_gemm_out(p.out, (size_t)m * p.N + n, v, p.out_f32, p.accumulate);
    }
}

static int bg_tiles(int N, int glu) { return glu ? (N + BG_BW / 2 - 1) / (BG_BW / 2) : (N + BG_BW - 1) / BG_BW; }

// Blocks per tile: as many as keep the grid within one wave of per_sm blocks per SM (2 fit with 4
// stages, 1 with 8), and >= BG_MIN_KT k-slices per block.
static int bg_per_sm(int per_sm) { return per_sm == 1 ? 1 : 2; }
static int bg_splits(int N, int K, int glu, int per_sm) {
    int tiles = bg_tiles(N, glu), slots = bg_per_sm(per_sm) * pd_k_num_sms(), kt = K / BG_BK;
    int s = slots / tiles;
    if (s > kt / BG_MIN_KT) s = kt / BG_MIN_KT;
    return s < 1 ? 1 : s;
}

extern "C" int pd_cuda_bgemm_supported(int M, int N, int K, int lda, int glu, int out_f32, const void *a, const void *w,
                                       int any_m) {
    return M >= (any_m ? 1 : PD_BGEMM_MIN_M) && M <= PD_BGEMM_MAX_M && N > 0 && N % 64 == 0 && K >= BG_BK &&
           K % BG_BK == 0 && lda >= K && lda % 8 == 0 && !(glu && out_f32) && ((uintptr_t)a & 15) == 0 &&
           ((uintptr_t)w & 15) == 0;
}

extern "C" int pd_cuda_bgemm_rope_supported(int N, int n_heads, int n_kv_heads, int head_dim) {
    return head_dim == BG_BW && n_heads > 0 && n_kv_heads > 0 && N == (n_heads + 2 * n_kv_heads) * head_dim;
}

extern "C" size_t pd_cuda_bgemm_workspace_bytes(int N, int glu, int per_sm) {
    // sized for the largest split count of any K: the partials of one wave of blocks
    size_t tiles = (size_t)bg_tiles(N, glu), slots = (size_t)bg_per_sm(per_sm) * (size_t)pd_k_num_sms();
    size_t splits = slots / tiles > 1 ? slots / tiles : 1;
    if (splits == 1) return 0;
    return BG_CNT_BYTES + splits * tiles * BG_TILE_F32 * sizeof(float);
}

extern "C" void pd_cuda_bgemm(const pd_bgemm_kparams *p, cudaStream_t s) {
    static bool attr_set[64];  // per device (benign race on first use, as pd_k_num_sms)
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64 || !attr_set[dev]) {
        cudaFuncSetAttribute(k_bgemm<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * BG_STAGE_BYTES);
        cudaFuncSetAttribute(k_bgemm<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * BG_STAGE_BYTES);
        if (dev >= 0 && dev < 64) attr_set[dev] = true;
    }
    bool deep = p->stages == 8;
    bg_args a;
    a.a = (const __nv_bfloat16 *)p->a;
    a.w = (const __nv_bfloat16 *)p->w;
    a.bias = (const __nv_bfloat16 *)p->bias;
    a.out = p->out;
    a.M = p->M, a.N = p->N, a.K = p->K, a.lda = p->lda ? p->lda : p->K;
    a.accumulate = p->accumulate, a.out_f32 = p->out_f32, a.glu = p->glu, a.hf = pd_k_hf_rounding();
    a.rope = p->rope, a.H = p->n_heads, a.Hkv = p->n_kv_heads;
    a.positions = p->positions, a.slot_mapping = p->slot_mapping, a.inv_freq = p->inv_freq;
    a.k_cache = (__nv_bfloat16 *)p->k_cache, a.v_cache = (__nv_bfloat16 *)p->v_cache, a.attn_scaling = p->attn_scaling;
    a.tiles = bg_tiles(p->N, p->glu);
    a.splits = bg_splits(p->N, p->K, p->glu, deep ? 1 : p->per_sm);
    int kt = p->K / BG_BK;
    a.kt_per = (kt + a.splits - 1) / a.splits;
    a.splits = (kt + a.kt_per - 1) / a.kt_per;  // no empty split
    a.cnt = (int *)p->ws;
    a.part = (float *)((char *)p->ws + BG_CNT_BYTES);
    dim3 grid((unsigned)a.tiles, (unsigned)a.splits);
    if (deep) pd_k_launch(k_bgemm<8>, grid, dim3(BG_THREADS), (size_t)(8 * BG_STAGE_BYTES), s, a);
    else pd_k_launch(k_bgemm<4>, grid, dim3(BG_THREADS), (size_t)(4 * BG_STAGE_BYTES), s, a);
}
