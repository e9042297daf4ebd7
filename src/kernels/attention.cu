// attention.cu — paged causal GQA attention: a tensor-core prefill kernel and split-K decode
// kernels (tensor cores for head_dim >= 64, CUDA cores for 32) and the merge of their partials.
// See attention.cuh for the contract.
//
// Prefill (k_attn_prefill<HD>): block = 8 warps = 128 query rows of one sequence and one head;
// each warp owns 16 rows. K/V tiles of BKV positions (below) are gathered through the page table
// into padded shared memory (row stride HD+8 elements, so ldmatrix rows hit distinct banks) with
// cp.async, double-buffered. S = Q.K^T and O += P.V run on mma.sync m16n8k16 (bf16 in, f32
// accumulate); the softmax is online (running max m and sum l per row, base-2 exponentials with
// scale*log2(e) folded into the scores). Causal masking only matters on the last tiles.
//
//   smem: Q [128][HD+8] | K [2][BKV][HD+8] | V [2][BKV][HD+8]   (HD=128: 102 KB; HD=64: 92 KB)
//
// Decode (k_attn_decode<HD, G>): block = 4 warps for one (sequence, kv head, partition). The G
// query heads of the kv head are processed together, so each K/V row is read once. A token's row
// is spread over HD/8 lanes (16 bytes each); a warp covers 32/(HD/8) tokens per step and loads
// PD_K_DEC_UNROLL steps ahead. Partials (o normalised, lse in base 2) go to the workspace when
// the sequence spans several partitions; otherwise the block writes the output directly. The
// partials are merged by k_attn_combine, or, when the tensor-core decode grid fits in one wave
// (small batches, where a step is a chain of short kernels), by the last block of each (sequence,
// kv head) to finish (a counter that block resets): that saves the combine launch, which a CUDA
// graph still pays on the critical path of every decode step. Only the one-wave (8-warp)
// instantiations carry the merge code: in the 4-warp ones it raised register spills and cost
// ~2% at batch 32-128. PD_CUDA_ATTN_FOLD=0 always launches the combine kernel (measurement knob).
// The tensor-core kernels (below) keep this grid, partitioning and workspace but run on mma.sync;
// they are the default for head_dim 64/128 (PD_CUDA_ATTN_TC=0 picks this one): k_attn_decode_bt
// for the bf16 cache and k_attn_decode_f8s for the fp8 cache, both in the transposed form (S^T =
// K.Q^T, O^T += V^T.P^T: tokens and dims fill the mma rows, not the <= 8 heads) with the next
// steps' K and V in flight in registers. k_attn_decode_tc (PD_CUDA_ATTN_BT=0) and its fp8 twin
// k_attn_decode_tc_f8 (PD_CUDA_ATTN_F8S=0) are the previous ones, kept as measurement baselines.
// The decode and combine kernels are launched with PDL (common.cuh); the prefill kernel and the
// CUDA-core decode kernel take F8 as a template flag.
// Partition sizing (pd_k_dec_part) aims at one wave; see there.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdio.h>

#include "kernels/attention.cuh"
#include "kernels/attention_prefill.cuh"
#include "kernels/common.cuh"

#define PD_K_ATT_BQ 128
// K/V positions per prefill tile (BKV): 128 for head_dim <= 64 (FlashAttention-2's forward kernel
// uses 128 x 128 tiles at head_dim 32 and 64), 64 above. The longer tile halves the syncs per query tile at
// small head sizes, and it moves where the online softmax rescales (a row's P is rounded to bf16
// relative to the running max of the tiles so far), which is where two flash kernels' bf16
// results differ.
#define PD_K_ATT_BKV_OF(HD) ((HD) <= 64 ? 128 : 64)
#define PD_K_ATT_WARPS 8
#define PD_K_LOG2E 1.4426950408889634f

#define PD_K_DEC_WARPS 4
#define PD_K_DEC_UNROLL 4
#define PD_K_DEC_MIN_PART 128
#define PD_K_DEC_MAX_SPLITS 128

// ---- fp8 KV (backend.h, PD_KV_FP8) -------------------------------------------------------------
// A slot's row: n_kv * HD e4m3 bytes, then n_kv f32 scales. Every kernel takes the caches as bytes
// plus row_bytes when F8; e4m3 -> bf16 is exact (cvt to f16x2, widen), the scale is applied in
// f32 to the scores (K) and to P (V), or, in the prefill tiles, before the bf16 rounding.

// Two e4m3 (low byte first) -> bf16x2 (low half first), exactly.
static __device__ __forceinline__ uint32_t pd_k_fp8x2_bf16x2(uint32_t v16) {
    __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v16, __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<__half2 *>(&hr));
    return pd_k_pack2(f.x, f.y);
}
// Eight e4m3 -> eight bf16 (the same 16-byte register layout a bf16 load would give).
static __device__ __forceinline__ uint4 pd_k_fp8x8_bf16x8(uint2 u) {
    return make_uint4(pd_k_fp8x2_bf16x2(u.x & 0xffffu), pd_k_fp8x2_bf16x2(u.x >> 16), pd_k_fp8x2_bf16x2(u.y & 0xffffu),
                      pd_k_fp8x2_bf16x2(u.y >> 16));
}
// Half h (bytes 8h .. 8h + 7) of 16 raw e4m3 bytes, widened to 8 bf16.
static __device__ __forceinline__ uint4 pd_k_f8_chunk(uint4 raw, int h) {
    return pd_k_fp8x8_bf16x8(h ? make_uint2(raw.z, raw.w) : make_uint2(raw.x, raw.y));
}

// Dims [d, d + 8) of head kvh at `slot` as 8 bf16 (bf16 cache) or 8 e4m3 widened to bf16 (fp8),
// and the head's scale (1 for bf16). slot < 0: zeros.
template <int HD, bool F8>
static __device__ __forceinline__ uint4 pd_k_kv_ld8(const void *c, int slot, int n_kv, int kvh, int d, size_t rb,
                                                    float *sc) {
    if (slot < 0) {
        *sc = 0.f;
        return make_uint4(0, 0, 0, 0);
    }
    if constexpr (F8) {
        const uint8_t *row = (const uint8_t *)c + (size_t)slot * rb;
        *sc = __ldg((const float *)(row + (size_t)n_kv * HD) + kvh);
        return pd_k_fp8x8_bf16x8(__ldg((const uint2 *)(row + (size_t)kvh * HD + d)));
    } else {
        *sc = 1.f;
        return __ldg((const uint4 *)((const __nv_bfloat16 *)c + ((size_t)slot * n_kv + kvh) * HD + d));
    }
}

// ---- prefill ---------------------------------------------------------------------------------

// bf16 tiles: cp.async, completed by the caller's wait (fp8: pd_k_att_f8_ld / _st below).
template <int HD>
static __device__ __forceinline__ void pd_k_att_load_kv(__nv_bfloat16 *ks, __nv_bfloat16 *vs, const void *kc,
                                                        const void *vc, const int32_t *bt, int kv0, int kv_end, int bs,
                                                        int n_kv, int kvh, size_t rb) {
    constexpr int CPR = HD / 8;  // 16-byte chunks per row
    constexpr int STR = HD + 8;
    constexpr int PD_K_ATT_BKV = PD_K_ATT_BKV_OF(HD);
    for (int c = threadIdx.x; c < PD_K_ATT_BKV * CPR; c += PD_K_ATT_WARPS * 32) {
        int r = c / CPR, ch = c % CPR, pos = kv0 + r;
        bool ok = pos < kv_end;
        size_t off = 0;
        if (ok) {
            size_t slot = (size_t)bt[pos / bs] * bs + pos % bs;
            off = (slot * n_kv + kvh) * HD + ch * 8;
        }
        pd_k_cp_async16(ks + r * STR + ch * 8, (const __nv_bfloat16 *)kc + off, ok);
        pd_k_cp_async16(vs + r * STR + ch * 8, (const __nv_bfloat16 *)vc + off, ok);
    }
}

// The fp8 tile load in two halves, so the global loads of tile j + 1 are in flight while tile j is
// computed: pd_k_att_f8_ld fetches this thread's raw rows and scales into registers, pd_k_att_f8_st
// dequantises them (x * scale, rounded to bf16) into the shared tile.
template <int HD>
struct pd_k_att_f8_regs {
    static constexpr int CH = (PD_K_ATT_BKV_OF(HD) * (HD / 8) + PD_K_ATT_WARPS * 32 - 1) / (PD_K_ATT_WARPS * 32);
    uint2 k[CH], v[CH];
    float ks[CH], vs[CH];
};

template <int HD>
static __device__ __forceinline__ void pd_k_att_f8_ld(pd_k_att_f8_regs<HD> &r, const void *kc, const void *vc,
                                                      const int32_t *bt, int kv0, int kv_end, int bs, int n_kv,
                                                      int kvh, size_t rb) {
    constexpr int CPR = HD / 8;
#pragma unroll
    for (int i = 0; i < pd_k_att_f8_regs<HD>::CH; i++) {
        int c = threadIdx.x + i * PD_K_ATT_WARPS * 32, row = c / CPR, ch = c % CPR, pos = kv0 + row;
        bool ok = c < PD_K_ATT_BKV_OF(HD) * CPR && pos < kv_end;
        r.k[i] = r.v[i] = make_uint2(0, 0);
        r.ks[i] = r.vs[i] = 0.f;
        if (ok) {
            size_t off = (size_t)(bt[pos / bs] * bs + pos % bs) * rb;
            const uint8_t *kr = (const uint8_t *)kc + off, *vr = (const uint8_t *)vc + off;
            r.k[i] = __ldg((const uint2 *)(kr + (size_t)kvh * HD + ch * 8));
            r.v[i] = __ldg((const uint2 *)(vr + (size_t)kvh * HD + ch * 8));
            r.ks[i] = __ldg((const float *)(kr + (size_t)n_kv * HD) + kvh);
            r.vs[i] = __ldg((const float *)(vr + (size_t)n_kv * HD) + kvh);
        }
    }
}

template <int HD>
static __device__ __forceinline__ void pd_k_att_f8_st(const pd_k_att_f8_regs<HD> &r, __nv_bfloat16 *ks,
                                                      __nv_bfloat16 *vs) {
    constexpr int CPR = HD / 8, STR = HD + 8;
#pragma unroll
    for (int i = 0; i < pd_k_att_f8_regs<HD>::CH; i++) {
        int c = threadIdx.x + i * PD_K_ATT_WARPS * 32, row = c / CPR, ch = c % CPR;
        if (c >= PD_K_ATT_BKV_OF(HD) * CPR) continue;
        float f[8];
        pd_k_unpack8(pd_k_fp8x8_bf16x8(r.k[i]), f);
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] *= r.ks[i];
        *(uint4 *)(ks + row * STR + ch * 8) = pd_k_pack8(f);
        pd_k_unpack8(pd_k_fp8x8_bf16x8(r.v[i]), f);
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] *= r.vs[i];
        *(uint4 *)(vs + row * STR + ch * 8) = pd_k_pack8(f);
    }
}

template <int HD, bool F8>
static __global__ void __launch_bounds__(PD_K_ATT_WARPS * 32)
    k_attn_prefill(const __nv_bfloat16 *q, const void *kc, const void *vc, __nv_bfloat16 *out,
                   const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                   const int32_t *bt_indices, int n_q_tiles, int H, int n_kv, int bs, int q_stride,
                   float scale_log2, size_t rb) {
    constexpr int STR = HD + 8;
    constexpr int PD_K_ATT_BKV = PD_K_ATT_BKV_OF(HD);
    extern __shared__ __align__(16) unsigned char pd_k_smem[];
    __nv_bfloat16 *qs = (__nv_bfloat16 *)pd_k_smem;
    __nv_bfloat16 *ks = qs + PD_K_ATT_BQ * STR;                      // [2][BKV][STR]
    __nv_bfloat16 *vs = ks + 2 * PD_K_ATT_BKV * STR;                 // [2][BKV][STR]

    int s = blockIdx.x / n_q_tiles;
    int qt = n_q_tiles - 1 - blockIdx.x % n_q_tiles;  // longest tiles first
    int h = blockIdx.y, kvh = h / (H / n_kv);
    int q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
    if (q_len <= 1 || qt * PD_K_ATT_BQ >= q_len) return;  // q_len == 1: the decode kernel's
    int kv_len = kv_lens[s];
    int row0 = qt * PD_K_ATT_BQ, row_end = min(q_len, row0 + PD_K_ATT_BQ);
    int pos0 = kv_len - q_len + row0;            // position of tile row 0
    int kv_end = kv_len - q_len + row_end;       // exclusive bound over the tile's rows
    const int32_t *bt = bt_indices + bt_indptr[s];
    int n_kv_tiles = (kv_end + PD_K_ATT_BKV - 1) / PD_K_ATT_BKV;

    // Q tile -> smem (rows past q_len zero).
    for (int c = threadIdx.x; c < PD_K_ATT_BQ * (HD / 8); c += PD_K_ATT_WARPS * 32) {
        int r = c / (HD / 8), ch = c % (HD / 8);
        bool ok = row0 + r < q_len;
        const __nv_bfloat16 *src = q + (size_t)(q_begin + (ok ? row0 + r : 0)) * q_stride + (size_t)h * HD + ch * 8;
        pd_k_cp_async16(qs + r * STR + ch * 8, src, ok);
    }
    pd_k_att_f8_regs<HD> f8r;  // F8: the next tile's raw rows (unused otherwise)
    if constexpr (F8) {
        pd_k_att_f8_ld<HD>(f8r, kc, vc, bt, 0, kv_end, bs, n_kv, kvh, rb);
        pd_k_att_f8_st<HD>(f8r, ks, vs);
    } else {
        pd_k_att_load_kv<HD>(ks, vs, kc, vc, bt, 0, kv_end, bs, n_kv, kvh, rb);
    }
    pd_k_cp_async_commit();

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int wr = warp * 16;  // warp's first row in the tile
    uint32_t qf[HD / 16][4];
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    int qpos[2] = {pos0 + wr + g, pos0 + wr + g + 8};

    for (int j = 0; j < n_kv_tiles; j++) {
        int buf = j & 1;
        if (F8 && j + 1 < n_kv_tiles) {
            pd_k_att_f8_ld<HD>(f8r, kc, vc, bt, (j + 1) * PD_K_ATT_BKV, kv_end, bs, n_kv, kvh, rb);
            pd_k_cp_async_wait<0>();  // the Q tile
        } else if (j + 1 < n_kv_tiles) {
            pd_k_att_load_kv<HD>(ks + (buf ^ 1) * PD_K_ATT_BKV * STR, vs + (buf ^ 1) * PD_K_ATT_BKV * STR, kc,
                                        vc, bt, (j + 1) * PD_K_ATT_BKV, kv_end, bs, n_kv, kvh, rb);
            pd_k_cp_async_commit();
            pd_k_cp_async_wait<1>();
        } else {
            pd_k_cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
                pd_k_ldmatrix_x4(qf[kk], qs + (wr + (lane & 15)) * STR + kk * 16 + (lane >> 4) * 8);
        }
        const __nv_bfloat16 *kt = ks + buf * PD_K_ATT_BKV * STR, *vt = vs + buf * PD_K_ATT_BKV * STR;
        int kv0 = j * PD_K_ATT_BKV;
        // Skip the whole tile for this warp if all its rows are before kv0 (causal).
        bool warp_live = pos0 + wr + 15 >= kv0;
        if (warp_live) {
            float sc[PD_K_ATT_BKV / 8][4];
#pragma unroll
            for (int nt = 0; nt < PD_K_ATT_BKV / 8; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk += 2) {
#pragma unroll
                for (int nt = 0; nt < PD_K_ATT_BKV / 8; nt++) {
                    uint32_t b[4];
                    pd_k_ldmatrix_x4(b, kt + (nt * 8 + (lane & 7)) * STR + kk * 16 + (lane >> 3) * 8);
                    pd_k_mma_bf16(sc[nt], qf[kk], b[0], b[1]);
                    pd_k_mma_bf16(sc[nt], qf[kk + 1], b[2], b[3]);
                }
            }
            // scale, mask, online softmax
            bool need_mask = kv0 + PD_K_ATT_BKV - 1 > pos0 + wr;
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int nt = 0; nt < PD_K_ATT_BKV / 8; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float v = sc[nt][i] * scale_log2;
                    if (need_mask) {
                        int kp = kv0 + nt * 8 + 2 * t + (i & 1);
                        if (kp > qpos[i >> 1]) v = -INFINITY;
                    }
                    sc[nt][i] = v;
                    mx[i >> 1] = fmaxf(mx[i >> 1], v);
                }
            }
            float corr[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                corr[r] = mx[r] == -INFINITY ? 1.f : exp2f(m[r] - mx[r]);
                m[r] = mx[r];
                l[r] *= corr[r];
            }
#pragma unroll
            for (int d = 0; d < HD / 8; d++) {
                o[d][0] *= corr[0];
                o[d][1] *= corr[0];
                o[d][2] *= corr[1];
                o[d][3] *= corr[1];
            }
            float base[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
#pragma unroll
            for (int nt = 0; nt < PD_K_ATT_BKV / 8; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float p = exp2f(sc[nt][i] - base[i >> 1]);
                    sc[nt][i] = p;
                    l[i >> 1] += p;
                }
            }
            // O += P V
#pragma unroll
            for (int kk = 0; kk < PD_K_ATT_BKV / 16; kk++) {
                uint32_t pa[4] = {pd_k_pack2(sc[2 * kk][0], sc[2 * kk][1]), pd_k_pack2(sc[2 * kk][2], sc[2 * kk][3]),
                                  pd_k_pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                  pd_k_pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
                for (int d = 0; d < HD / 8; d += 2) {
                    uint32_t b[4];
                    pd_k_ldmatrix_x4_trans(b, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STR + d * 8 +
                                                  (lane >> 4) * 8);
                    pd_k_mma_bf16(o[d], pa, b[0], b[1]);
                    pd_k_mma_bf16(o[d + 1], pa, b[2], b[3]);
                }
            }
        }
        // F8: tile j + 1 into the other buffer (its readers, iteration j - 1, passed the barrier below)
        if (F8 && j + 1 < n_kv_tiles)
            pd_k_att_f8_st<HD>(f8r, ks + (buf ^ 1) * PD_K_ATT_BKV * STR, vs + (buf ^ 1) * PD_K_ATT_BKV * STR);
        __syncthreads();  // buffer buf is refilled next iteration
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        l[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = row0 + wr + g + r * 8;
        if (row >= q_len) continue;
        __nv_bfloat16 *dst = out + (size_t)(q_begin + row) * H * HD + (size_t)h * HD;
#pragma unroll
        for (int d = 0; d < HD / 8; d++)
            *(uint32_t *)(dst + d * 8 + 2 * t) = pd_k_pack2(o[d][2 * r] * l[r], o[d][2 * r + 1] * l[r]);
    }
}

// ---- decode ----------------------------------------------------------------------------------

// Waves of blocks the split aims at when the grid is large (PD_CUDA_ATTN_WAVES, a measurement
// knob). 1 since the pipelined kernels: on an H100, batch 64 at ctx 512 goes from 62.6 to 54.1 us
// (2 partitions and a combine launch -> 1) and the whole decode step from 8.07 to 7.83 ms, batch 32
// from 7.20 to 7.00 ms; 4 (the old default) gained nothing anywhere.
static int pd_k_dec_waves() {
    static int w = -1;
    if (w < 0) {
        const char *e = getenv("PD_CUDA_ATTN_WAVES");
        w = e && atoi(e) > 0 && atoi(e) <= 64 ? atoi(e) : 1;
    }
    return w;
}

// When the (sequence, kv head) pairs are at most half the SMs (batch <= 8 for 8 kv heads), each is
// split into as many partitions as make one wave of 8-warp blocks, which merge in place (no
// combine launch), instead of ~4 waves of 4-warp blocks: on an H100, single-stream attention at
// 8k goes from 21.5 to 12.7 us (1.56 -> 2.64 TB/s on the K/V bytes), at 32k from 74 to 56 us, and
// batch 8 at 32k from 411 to 391 us. PD_CUDA_ATTN_ONEWAVE=0: the old sizing (measurement knob).
static bool pd_k_attn_onewave() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_ONEWAVE", &on);
}

static inline int pd_k_dec_part(int n_seqs, int n_kv, int max_kv_len) {
    int want = (pd_k_dec_waves() * 132 + n_seqs * n_kv - 1) / (n_seqs * n_kv);  // waves on an H100
    if (pd_k_attn_onewave() && n_seqs * n_kv * 2 <= pd_k_num_sms()) {
        int w1 = pd_k_num_sms() / (n_seqs * n_kv);
        if (w1 > PD_K_DEC_MAX_SPLITS) w1 = PD_K_DEC_MAX_SPLITS;
        int part = (max_kv_len + w1 - 1) / w1;
        part = (part + 63) / 64 * 64;
        if (part < PD_K_DEC_MIN_PART) part = PD_K_DEC_MIN_PART;
        return part;  // ceil(max_kv_len / part) <= w1 splits: one wave
    }
    if (want < 1) want = 1;
    int part = (max_kv_len + want - 1) / want;
    if (part < PD_K_DEC_MIN_PART) part = PD_K_DEC_MIN_PART;
    int min_part = (max_kv_len + PD_K_DEC_MAX_SPLITS - 1) / PD_K_DEC_MAX_SPLITS;
    if (part < min_part) part = min_part;
    return (part + 63) / 64 * 64;
}

// Merges the warps' partial (acc, m, l) in red (red[w][gi][HD] = m, [HD + 1] = l, both base 2) and
// writes the normalised output (one partition) or the partial and its lse to the workspace. With
// MERGE and cnt (the in-place merge, see the top of the file) the block that finishes last among
// the n_sp of this sequence and kv head then merges their partials into the output and resets the
// counter.
template <int HD, int GM, int W = PD_K_DEC_WARPS, bool MERGE = false>
static __device__ __forceinline__ void pd_k_dec_finish(float (*red)[GM][HD + 2], __nv_bfloat16 *out, float *ws,
                                                       int *cnt, int q_begin, int s, int kvh, int G, int H, int split,
                                                       int n_sp, int n_splits) {
    for (int e = threadIdx.x; e < G * HD; e += W * 32) {
        int gi = e / HD, d = e % HD;
        float mn = -INFINITY;
#pragma unroll
        for (int w = 0; w < W; w++) mn = fmaxf(mn, red[w][gi][HD]);
        float lt = 0.f, v = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) {
            float mw = red[w][gi][HD];
            float f = mw == -INFINITY ? 0.f : exp2f(mw - mn);
            lt += red[w][gi][HD + 1] * f;
            v += red[w][gi][d] * f;
        }
        int h = kvh * G + gi;
        float r = lt > 0.f ? v / lt : 0.f;
        if (n_sp == 1) {
            out[(size_t)q_begin * H * HD + (size_t)h * HD + d] = __float2bfloat16(r);
        } else {
            float *wo = ws + ((size_t)(s * H + h) * n_splits + split) * (HD + 1);
            wo[d] = r;
            if (d == 0) wo[HD] = mn + log2f(lt);
        }
    }
    if (!MERGE || n_sp == 1 || !cnt) return;
    // Publish the partial, then count this block in (the threadFenceReduction pattern).
    __shared__ int is_last;
    __shared__ float wgt[GM][PD_K_DEC_MAX_SPLITS];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int *c = cnt + (size_t)s * (H / G) + kvh;
        is_last = atomicAdd(c, 1) == n_sp - 1;
        if (is_last) *c = 0;  // every block of this (s, kvh) has counted: ready for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // One warp per head: the partials' weights exp2(lse_i - max) / sum, in shared memory.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int gi = warp; gi < G; gi += W) {
        const float *w0 = ws + (size_t)(s * H + kvh * G + gi) * n_splits * (HD + 1);
        float mx = -INFINITY;
        for (int i = lane; i < n_sp; i += 32) {
            float v = __ldcg(w0 + (size_t)i * (HD + 1) + HD);
            wgt[gi][i] = v;
            mx = fmaxf(mx, v);
        }
        mx = pd_k_warp_max(mx);
        float den = 0.f;
        for (int i = lane; i < n_sp; i += 32) {
            float f = exp2f(wgt[gi][i] - mx);
            wgt[gi][i] = f;
            den += f;
        }
        den = pd_k_warp_sum(den);
        __syncwarp();
        for (int i = lane; i < n_sp; i += 32) wgt[gi][i] /= den;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * HD; e += W * 32) {
        int gi = e / HD, d = e % HD;
        const float *w0 = ws + (size_t)(s * H + kvh * G + gi) * n_splits * (HD + 1) + d;
        float v = 0.f;
#pragma unroll 8
        for (int i = 0; i < n_sp; i++) v += wgt[gi][i] * __ldcg(w0 + (size_t)i * (HD + 1));
        out[(size_t)q_begin * H * HD + (size_t)(kvh * G + gi) * HD + d] = __float2bfloat16(v);
    }
}

template <int HD, int GM, bool F8>
static __global__ void __launch_bounds__(PD_K_DEC_WARPS * 32)
    k_attn_decode(const __nv_bfloat16 *q, const void *kc, const void *vc, __nv_bfloat16 *out,
                  const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                  const int32_t *bt_indices, int H, int n_kv, int bs, int q_stride, float scale_log2, int part,
                  int n_splits, float *ws, int *cnt, size_t rb, int n_new) {
    constexpr int LPT = HD / 8, TPW = 32 / LPT, U = PD_K_DEC_UNROLL;
    __shared__ float red[PD_K_DEC_WARPS][GM][HD + 2];
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    int q_begin = q_indptr[s];
    if (q_indptr[s + 1] - q_begin != 1) return;  // prefill kernel's
    int kv_len = kv_lens[s];
    int k_begin = split * part, k_end = min(kv_len, k_begin + part);
    if (k_begin >= kv_len) return;
    int n_sp = (kv_len + part - 1) / part;
    int G = H / n_kv;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPT, d8 = lane % LPT;
    const int32_t *bt = bt_indices + bt_indptr[s];

    float qv[GM][8], acc[GM][8], m[GM], l[GM];
#pragma unroll
    for (int gi = 0; gi < GM; gi++) {
        m[gi] = -INFINITY;
        l[gi] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[gi][i] = 0.f;
        if (gi < G) {
            uint4 u = *(const uint4 *)(q + (size_t)q_begin * q_stride + (size_t)(kvh * G + gi) * HD + d8 * 8);
            pd_k_unpack8(u, qv[gi]);
#pragma unroll
            for (int i = 0; i < 8; i++) qv[gi][i] *= scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) qv[gi][i] = 0.f;
        }
    }
    constexpr int STEP = PD_K_DEC_WARPS * TPW * U;
    for (int base = k_begin; base < k_end; base += STEP) {
        uint4 kr[U], vr[U];
        float ksc[U], vsc[U];  // per-token scales (fp8 cache; 1 for bf16)
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int pos = base + (u * PD_K_DEC_WARPS + warp) * TPW + sub;
            ok[u] = pos < k_end;
            int slot = ok[u] ? bt[pos / bs] * bs + pos % bs : -1;
            kr[u] = pd_k_kv_ld8<HD, F8>(kc, slot, n_kv, kvh, d8 * 8, rb, &ksc[u]);
            vr[u] = pd_k_kv_ld8<HD, F8>(vc, slot, n_kv, kvh, d8 * 8, rb, &vsc[u]);
        }
        // scores of the U tokens for every head, then one max/correction per step (not per token)
        float sc[U][GM];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[8];
            pd_k_unpack8(kr[u], kf);
#pragma unroll
            for (int gi = 0; gi < GM; gi++) {
                float d = 0.f;
                if (gi < G) {
#pragma unroll
                    for (int i = 0; i < 8; i++) d += qv[gi][i] * kf[i];
#pragma unroll
                    for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                }
                sc[u][gi] = ok[u] ? (F8 ? d * ksc[u] : d) : -INFINITY;
            }
        }
#pragma unroll
        for (int gi = 0; gi < GM; gi++) {
            if (gi >= G) continue;
            float mn = m[gi];
#pragma unroll
            for (int u = 0; u < U; u++) mn = fmaxf(mn, sc[u][gi]);
            if (mn == -INFINITY) continue;  // no valid token for this lane group yet
            float corr = exp2f(m[gi] - mn);
            m[gi] = mn;
            l[gi] *= corr;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[gi][i] *= corr;
#pragma unroll
            for (int u = 0; u < U; u++) sc[u][gi] = exp2f(sc[u][gi] - mn);  // -inf -> 0
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float vf[8];
            pd_k_unpack8(vr[u], vf);
#pragma unroll
            for (int gi = 0; gi < GM; gi++) {
                if (gi >= G || m[gi] == -INFINITY) continue;
                float p = sc[u][gi];
                l[gi] += p;
                if (F8) p *= vsc[u];
#pragma unroll
                for (int i = 0; i < 8; i++) acc[gi][i] += p * vf[i];
            }
        }
    }
    // merge the token groups of the warp
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int gi = 0; gi < GM; gi++) {
            float mo = __shfl_xor_sync(0xffffffffu, m[gi], o), lo = __shfl_xor_sync(0xffffffffu, l[gi], o);
            float mn = fmaxf(m[gi], mo);
            float a = mn == -INFINITY ? 0.f : exp2f(m[gi] - mn), b = mn == -INFINITY ? 0.f : exp2f(mo - mn);
            l[gi] = l[gi] * a + lo * b;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[gi][i] = acc[gi][i] * a + __shfl_xor_sync(0xffffffffu, acc[gi][i], o) * b;
            m[gi] = mn;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int gi = 0; gi < GM; gi++) {
            if (gi >= G) continue;
#pragma unroll
            for (int i = 0; i < 8; i++) red[warp][gi][d8 * 8 + i] = acc[gi][i];
            if (d8 == 0) {
                red[warp][gi][HD] = m[gi];
                red[warp][gi][HD + 1] = l[gi];
            }
        }
    }
    __syncthreads();
    pd_k_dec_finish<HD, GM>(red, out, ws, cnt, q_begin, s, kvh, G, H, split, n_sp, n_splits);
}

// ---- decode on tensor cores ------------------------------------------------------------------
//
// k_attn_decode_tc<HD, GM, W>: same grid, partitions, outputs and workspace as k_attn_decode, but
// the scores and P.V run on mma.sync with the G query heads of the kv head as the M rows (padded
// to 16, rows >= G are zero) and no shared memory for K/V: every warp takes 16 tokens per step
// (steps interleaved over the W warps) and loads them straight into registers. Lane (g, t) loads
// 16 bytes of token g (and g + 8) for dims i*32 + t*8 .. +8 (i < HD/32): 64 contiguous bytes per
// token and group across the 4 lanes. For S = Q.K^T those registers are the B fragments as is
// (the dot product is order-free, and Q is loaded with the same permutation of dims). For O +=
// P.V the reduction axis is the token, so each 8x8 block of V is transposed in registers
// (movmatrix.trans), which makes lane (g, t) hold V[tokens 2t, 2t+1][one dim]; P comes straight
// from the S accumulators (FlashAttention-2 register reuse). Lane (g, t) ends with dims
// i*32 + t*8 .. +8 of head g. Online softmax per step, base 2, scale applied in fp32.

static __device__ __forceinline__ uint32_t pd_k_movmatrix_trans(uint32_t a) {
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

static __device__ __forceinline__ uint32_t pd_k_u4_get(const uint4 &u, int r) {
    return r == 0 ? u.x : r == 1 ? u.y : r == 2 ? u.z : u.w;
}

// Cache slot of token pos (through the page table), or -1 past k_end.
// Block sizes that are powers of two (all the engine uses) take shifts instead of an integer
// division (a uniform branch; the division is ~20 instructions, twice per step and warp).
static __device__ __forceinline__ int pd_k_dec_slot(const int32_t *bt, int pos, int k_end, int bs) {
    if (pos >= k_end) return -1;
    if ((bs & (bs - 1)) == 0) return bt[pos >> (__ffs(bs) - 1)] * bs + (pos & (bs - 1));
    return bt[pos / bs] * bs + pos % bs;
}

// One step of 16 tokens (base .. base + 15) for this warp: S = Q.K^T on tensor cores, online
// softmax (rows = heads, base 2), O += P.V with V transposed in registers.
// F8 (k_attn_decode_tc_f8): K/V come as raw e4m3 (rk/rv: 16 bytes per lane and token, see there)
// and are widened to bf16 here, next to their use; ks[j] / vs[j] are the scales of the token of
// p[j] (column (j >> 1) * 8 + 2t + (j & 1)): the score is scaled by K's, and P by V's after the row
// sum (the sum is over the softmax weights). Otherwise kr/vr hold bf16 and the scales are unused.
template <int NI, bool F8, int NR>
static __device__ __forceinline__ void pd_k_dec_tc_step(const uint4 (&qf)[NI], const uint4 (&kr)[2][NR],
                                                        const uint4 (&vr)[2][NR], float (&o)[NI][4][4], float &m,
                                                        float &l, int base, int k_end, int t, float scale_log2,
                                                        const float (&ks)[4], const float (&vs)[4]) {
    // S (rows = heads, cols = tokens base + hh*8 + 2t, +1)
    float sc[2][4];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        sc[hh][0] = sc[hh][1] = sc[hh][2] = sc[hh][3] = 0.f;
#pragma unroll
        for (int i = 0; i < NI; i++) {
            uint32_t a0[4] = {qf[i].x, 0u, qf[i].y, 0u}, a1[4] = {qf[i].z, 0u, qf[i].w, 0u};
            uint4 kb = F8 ? pd_k_f8_chunk(kr[hh][i >> 1], i & 1) : kr[hh][i];
            pd_k_mma_bf16(sc[hh], a0, kb.x, kb.y);
            pd_k_mma_bf16(sc[hh], a1, kb.z, kb.w);
        }
    }
    float p[4], mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int pos = base + (j >> 1) * 8 + 2 * t + (j & 1);
        p[j] = pos < k_end ? sc[j >> 1][j & 1] * (F8 ? scale_log2 * ks[j] : scale_log2) : -INFINITY;
        mx = fmaxf(mx, p[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float mn = fmaxf(m, mx);  // finite: token `base` is valid for every row
    float corr = exp2f(m - mn);  // m = -inf -> 0
    m = mn;
    float ps = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        p[j] = exp2f(p[j] - mn);  // -inf -> 0
        ps += p[j];
    }
    l = l * corr + ps;
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            o[i][r][0] *= corr;
            o[i][r][1] *= corr;
        }
    if (F8) {
#pragma unroll
        for (int j = 0; j < 4; j++) p[j] *= vs[j];
    }
    uint32_t pa[4] = {pd_k_pack2(p[0], p[1]), 0u, pd_k_pack2(p[2], p[3]), 0u};
#pragma unroll
    for (int i = 0; i < NI; i++) {
        uint4 v0 = F8 ? pd_k_f8_chunk(vr[0][i >> 1], i & 1) : vr[0][i];
        uint4 v1 = F8 ? pd_k_f8_chunk(vr[1][i >> 1], i & 1) : vr[1][i];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            uint32_t b0 = pd_k_movmatrix_trans(pd_k_u4_get(v0, r));
            uint32_t b1 = pd_k_movmatrix_trans(pd_k_u4_get(v1, r));
            pd_k_mma_bf16(o[i][r], pa, b0, b1);
        }
    }
}

// W warps per block (4, or 8 when the grid is smaller than the GPU: each warp then has fewer
// steps in its dependent chain). The batch metadata and the first step's page-table lookups are
// read before pd_k_pdl_wait(): they are uploaded by the host before the step and never written
// by a kernel, unlike Q and the newest K/V row (written by rope_kv just before); later steps'
// lookups are issued one step ahead.
// PIPE: the next step's K is loaded before this step's math (one step of software pipelining, as in
// the fp8 kernel; this step's V is only needed after the softmax). PD_CUDA_ATTN_PIPE=0: off.
template <int HD, int GM, int W, bool PIPE>
static __global__ void __launch_bounds__(W * 32, W == 4 ? (PIPE ? 2 : 3) : 1)
    k_attn_decode_tc(const __nv_bfloat16 *q, const void *kc, const void *vc, __nv_bfloat16 *out,
                     const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                     const int32_t *bt_indices, int H, int n_kv, int bs, int q_stride, float scale_log2, int part,
                     int n_splits, float *ws, int *cnt, size_t rb, int n_new) {
    constexpr int NI = HD / 32;
    __shared__ float red[W][GM][HD + 2];
    pd_k_pdl_trigger();
    int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    int q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
    int kv_len = kv_lens[s];
    const int32_t *bt = bt_indices + bt_indptr[s];
    int k_begin = split * part, k_end = min(kv_len, k_begin + part);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bool live = q_len == 1 && k_begin < kv_len;  // else: the prefill kernel's, or past this context
    int slot[2] = {-1, -1};
    if (live) {
        slot[0] = pd_k_dec_slot(bt, k_begin + warp * 16 + g, k_end, bs);
        slot[1] = pd_k_dec_slot(bt, k_begin + warp * 16 + 8 + g, k_end, bs);
    }
    pd_k_pdl_wait();
    if (!live) return;
    int n_sp = (kv_len + part - 1) / part;
    int G = H / n_kv;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 qf[NI];
#pragma unroll
    for (int i = 0; i < NI; i++)
        qf[i] = g < G ? *(const uint4 *)(q + (size_t)q_begin * q_stride + (size_t)(kvh * G + g) * HD + i * 32 + t * 8)
                      : zero;
    float o[NI][4][4];
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) o[i][r][0] = o[i][r][1] = o[i][r][2] = o[i][r][3] = 0.f;
    float m = -INFINITY, l = 0.f;

    const float ks[4] = {1.f, 1.f, 1.f, 1.f}, vs[4] = {1.f, 1.f, 1.f, 1.f};
    float sc_unused;
    uint4 kr[2][NI];  // PIPE: this step's K, loaded during the previous step
    if (PIPE) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
#pragma unroll
            for (int i = 0; i < NI; i++)
                kr[hh][i] = pd_k_kv_ld8<HD, false>(kc, slot[hh], n_kv, kvh, i * 32 + t * 8, rb, &sc_unused);
    }
    for (int base = k_begin + warp * 16; base < k_end; base += W * 16) {
        uint4 vr[2][NI], kn[2][NI];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
#pragma unroll
            for (int i = 0; i < NI; i++) {
                if (!PIPE) kr[hh][i] = pd_k_kv_ld8<HD, false>(kc, slot[hh], n_kv, kvh, i * 32 + t * 8, rb, &sc_unused);
                vr[hh][i] = pd_k_kv_ld8<HD, false>(vc, slot[hh], n_kv, kvh, i * 32 + t * 8, rb, &sc_unused);
            }
        }
        // next step's page-table lookups (and, PIPE, its K: in flight during this step's math)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) slot[hh] = pd_k_dec_slot(bt, base + W * 16 + hh * 8 + g, k_end, bs);
        if (PIPE) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
#pragma unroll
                for (int i = 0; i < NI; i++)
                    kn[hh][i] = pd_k_kv_ld8<HD, false>(kc, slot[hh], n_kv, kvh, i * 32 + t * 8, rb, &sc_unused);
        }
        pd_k_dec_tc_step<NI, false>(qf, kr, vr, o, m, l, base, k_end, t, scale_log2, ks, vs);
        if (PIPE) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
#pragma unroll
                for (int i = 0; i < NI; i++) kr[hh][i] = kn[hh][i];
        }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < G) {
#pragma unroll
        for (int i = 0; i < NI; i++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                red[warp][g][i * 32 + t * 8 + 2 * r] = o[i][r][0];
                red[warp][g][i * 32 + t * 8 + 2 * r + 1] = o[i][r][1];
            }
        if (t == 0) {
            red[warp][g][HD] = m;
            red[warp][g][HD + 1] = l;
        }
    }
    __syncthreads();
    pd_k_dec_finish<HD, GM, W, W == 8>(red, out, ws, cnt, q_begin, s, kvh, G, H, split, n_sp, n_splits);
}

// k_attn_decode_tc_f8: k_attn_decode_tc on the fp8 cache. Lane (g, t) loads 16 raw e4m3 bytes per
// token (g and g + 8) and 64 dims: dims c*64 + t*16 .. +16 for c < HD/64, i.e. chunk i (of 8 dims,
// i < HD/32) is dims (i >> 1)*64 + t*16 + (i & 1)*8 (pd_k_f8_dim); Q is loaded with the same
// permutation, so S is unchanged, and the output dims follow it. Each token's scales are loaded once
// per step by its lanes and handed to the lanes whose score columns hold it. The next step's raw
// bytes are loaded before this step's math (fp8 halves the registers a step holds, so the loop can
// be software-pipelined one step deep).
static __device__ __forceinline__ int pd_k_f8_dim(int i, int t) { return (i >> 1) * 64 + t * 16 + (i & 1) * 8; }

template <int HD>
struct pd_k_f8_step_regs {
    uint4 k[2][HD / 64], v[2][HD / 64];
    float ks[2], vs[2];
};

template <int HD>
static __device__ __forceinline__ void pd_k_f8_load(pd_k_f8_step_regs<HD> &r, const uint8_t *kc, const uint8_t *vc,
                                                    const int (&slot)[2], int n_kv, int kvh, int t, size_t rb) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        if (slot[hh] >= 0) {
            const uint8_t *kr = kc + (size_t)slot[hh] * rb, *vr = vc + (size_t)slot[hh] * rb;
#pragma unroll
            for (int c = 0; c < HD / 64; c++) {
                r.k[hh][c] = __ldg((const uint4 *)(kr + (size_t)kvh * HD + c * 64 + t * 16));
                r.v[hh][c] = __ldg((const uint4 *)(vr + (size_t)kvh * HD + c * 64 + t * 16));
            }
            r.ks[hh] = __ldg((const float *)(kr + (size_t)n_kv * HD) + kvh);
            r.vs[hh] = __ldg((const float *)(vr + (size_t)n_kv * HD) + kvh);
        } else {
#pragma unroll
            for (int c = 0; c < HD / 64; c++) r.k[hh][c] = r.v[hh][c] = make_uint4(0, 0, 0, 0);
            r.ks[hh] = r.vs[hh] = 0.f;
        }
    }
}

// Two 4-warp blocks per SM (not three as in bf16): the pipelined step needs ~210 registers, and
// each warp already keeps two steps of loads in flight.
template <int HD, int GM, int W>
static __global__ void __launch_bounds__(W * 32, W == 4 ? 2 : 1)
    k_attn_decode_tc_f8(const __nv_bfloat16 *q, const void *kc_, const void *vc_, __nv_bfloat16 *out,
                        const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                        const int32_t *bt_indices, int H, int n_kv, int bs, int q_stride, float scale_log2, int part,
                        int n_splits, float *ws, int *cnt, size_t rb, int n_new) {
    constexpr int NI = HD / 32;
    __shared__ float red[W][GM][HD + 2];
    const uint8_t *kc = (const uint8_t *)kc_, *vc = (const uint8_t *)vc_;
    pd_k_pdl_trigger();
    int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    int q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
    int kv_len = kv_lens[s];
    const int32_t *bt = bt_indices + bt_indptr[s];
    int k_begin = split * part, k_end = min(kv_len, k_begin + part);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bool live = q_len == 1 && k_begin < kv_len;
    int slot[2] = {-1, -1};
    if (live) {
        slot[0] = pd_k_dec_slot(bt, k_begin + warp * 16 + g, k_end, bs);
        slot[1] = pd_k_dec_slot(bt, k_begin + warp * 16 + 8 + g, k_end, bs);
    }
    pd_k_pdl_wait();
    if (!live) return;
    int n_sp = (kv_len + part - 1) / part;
    int G = H / n_kv;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 qf[NI];
#pragma unroll
    for (int i = 0; i < NI; i++)
        qf[i] = g < G ? *(const uint4 *)(q + (size_t)q_begin * q_stride + (size_t)(kvh * G + g) * HD + pd_k_f8_dim(i, t))
                      : zero;
    float o[NI][4][4];
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) o[i][r][0] = o[i][r][1] = o[i][r][2] = o[i][r][3] = 0.f;
    float m = -INFINITY, l = 0.f;

    pd_k_f8_step_regs<HD> cur, nxt;
    pd_k_f8_load<HD>(cur, kc, vc, slot, n_kv, kvh, t, rb);
    for (int base = k_begin + warp * 16; base < k_end; base += W * 16) {
        int ns[2] = {pd_k_dec_slot(bt, base + W * 16 + g, k_end, bs), pd_k_dec_slot(bt, base + W * 16 + 8 + g, k_end, bs)};
        pd_k_f8_load<HD>(nxt, kc, vc, ns, n_kv, kvh, t, rb);  // in flight during this step's math
        float ks[4], vs[4];  // p[j]'s token is column (j >> 1) * 8 + 2t + (j & 1): lanes of g = 2t + (j & 1)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            ks[j] = __shfl_sync(0xffffffffu, cur.ks[j >> 1], (2 * t + (j & 1)) * 4);
            vs[j] = __shfl_sync(0xffffffffu, cur.vs[j >> 1], (2 * t + (j & 1)) * 4);
        }
        pd_k_dec_tc_step<NI, true>(qf, cur.k, cur.v, o, m, l, base, k_end, t, scale_log2, ks, vs);
        cur = nxt;
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < G) {
#pragma unroll
        for (int i = 0; i < NI; i++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                red[warp][g][pd_k_f8_dim(i, t) + 2 * r] = o[i][r][0];
                red[warp][g][pd_k_f8_dim(i, t) + 2 * r + 1] = o[i][r][1];
            }
        if (t == 0) {
            red[warp][g][HD] = m;
            red[warp][g][HD + 1] = l;
        }
    }
    __syncthreads();
    pd_k_dec_finish<HD, GM, W, W == 8>(red, out, ws, cnt, q_begin, s, kvh, G, H, split, n_sp, n_splits);
}

// ---- fp8 decode, streaming version -------------------------------------------------------------
//
// k_attn_decode_f8s<HD, GM, W, DEPTH, T2>: k_attn_decode_tc_f8's grid, partitions, load layout
// (lane (g, t): tokens g and g + 8 of each 16-token tile, bytes c*64 + t*16 .. +16 of the head for
// c < HD/64) and outputs, computed in the transposed form (S^T = K.Q^T with the 16 tokens as mma
// rows and the heads as the n8 columns, O^T += V^T.P^T with 16 dims as rows: no padding rows), with
// the e4m3 bytes fed to the tensor cores at one instruction per two elements: cvt.rn.f16x2.e4m3x2
// is exact, and the mma runs in f16 (f32 accumulate) instead of bf16 (widening to bf16 took four), so
//   * S^T: Q is converted to f16 once, times a power of two (2^(13 - e), e = exponent of the head's
//     max |q|, so |q| < 2^14 and no bf16 value of q loses a bit unless it is 2^-28 below the max);
//     the power of two and the per-token K scale are applied to the score in f32 (one multiply per
//     score, folded with scale*log2(e)); a lane's score rows are its own loaded tokens, so it
//     holds their scales;
//   * O^T: the reduction axis is the token, so each lane needs two tokens of one dim in a register.
//     The raw bytes are transposed before widening: movmatrix on 16-bit units (two dims of one
//     token) gives lane (g, t) the units of tokens 2t and 2t + 1 of one dim pair, a byte permute
//     interleaves them, and two cvts give the two dims' A fragments (rows g and g + 8). P^T (the B
//     operand) is two movmatrix of the packed weights. P must be f16, and the per-token V scale goes
//     into P: the weights exp2(s + log2(vs) - m2) with their own running max m2 (so the largest is 1
//     and f16's range is never an issue, whatever the scales), while l keeps the usual running max
//     m; at the end the accumulator moves to m's frame (times exp2(m2 - m));
//   * a warp's step is T2 tiles of 16 tokens sharing one softmax update (max reductions and the
//     accumulator rescale, skipped when no max moved), and the next DEPTH steps' raw bytes are in
//     flight (DEPTH + 1 register buffers, the loop unrolled over them so they stay registers).
// PD_CUDA_ATTN_F8S=0: the previous kernel (k_attn_decode_tc_f8); PD_CUDA_ATTN_F8TILES=1|2 (below).
// Lane (g, t) ends with o[c][w][0..3] = O^T[dim c*64 + (g >> 1)*16 + 4w + 2(g & 1) (+ 1 for [2],
// [3])][head 2t ([0], [2]) or 2t + 1 ([1], [3])].

static __device__ __forceinline__ uint32_t pd_k_e4m3x2_f16x2(uint32_t v) {  // low 16 bits
    uint32_t d;
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(d) : "r"(v));
    return d;
}
static __device__ __forceinline__ uint32_t pd_k_e4m3x2_f16x2_hi(uint32_t v) {  // high 16 bits
    uint32_t d;
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(d) : "r"(v));
    return d;
}
static __device__ __forceinline__ uint32_t pd_k_prmt(uint32_t a, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(d) : "r"(a), "r"(sel));
    return d;
}
static __device__ __forceinline__ uint32_t pd_k_pack2_f16(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);  // .x = a (low half)
    return *reinterpret_cast<uint32_t *>(&h);
}
// d (16x8 f32) += a (16x16 f16, row) * b (16x8 f16, col)
static __device__ __forceinline__ void pd_k_mma_f16(float d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of T2 tiles of 16 tokens (tile i: base + 16i .. + 15) for this warp from the raw bytes
// in r[i] (see above); the tiles share one softmax update (one max reduction and one rescale).
template <int HD, int T2>
static __device__ __forceinline__ void pd_k_f8s_step(const uint32_t (&qh)[HD / 64][8],
                                                     const pd_k_f8_step_regs<HD> *const (&r)[T2],
                                                     float (&o)[HD / 64][4][4], float (&m)[2], float (&m2)[2],
                                                     float (&l)[2], int base, int k_end, int g, const float (&sl)[2]) {
    constexpr int NC = HD / 64;
    // S^T (rows = tokens g, g + 8; cols = heads): two accumulators per tile (even and odd words) to
    // halve the mma dependency chain
    float sa[T2][2][4];
#pragma unroll
    for (int i = 0; i < T2; i++)
#pragma unroll
        for (int a = 0; a < 2; a++) sa[i][a][0] = sa[i][a][1] = sa[i][a][2] = sa[i][a][3] = 0.f;
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int w = 0; w < 4; w++)
#pragma unroll
            for (int i = 0; i < T2; i++) {
                uint32_t k0 = pd_k_u4_get(r[i]->k[0][c], w), k1 = pd_k_u4_get(r[i]->k[1][c], w);
                pd_k_mma_f16(sa[i][w & 1], pd_k_e4m3x2_f16x2(k0), pd_k_e4m3x2_f16x2(k1), pd_k_e4m3x2_f16x2_hi(k0),
                             pd_k_e4m3x2_f16x2_hi(k1), qh[c][2 * w], qh[c][2 * w + 1]);
            }
    // p[i][j]: token 16i + (j >> 1) * 8 + g (this lane's own loads, so its own scales), head 2t + (j & 1)
    float p[T2][4], q2[T2][4], mx[2] = {-INFINITY, -INFINITY}, mx2[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < T2; i++) {
        bool ok[2] = {base + 16 * i + g < k_end, base + 16 * i + 8 + g < k_end};
        float lv[2] = {__log2f(r[i]->vs[0]), __log2f(r[i]->vs[1])};  // vs = 0: -inf
#pragma unroll
        for (int j = 0; j < 4; j++) {
            p[i][j] = ok[j >> 1] ? (sa[i][0][j] + sa[i][1][j]) * (sl[j & 1] * r[i]->ks[j >> 1]) : -INFINITY;
            q2[i][j] = p[i][j] + lv[j >> 1];
            mx[j & 1] = fmaxf(mx[j & 1], p[i][j]);
            mx2[j & 1] = fmaxf(mx2[j & 1], q2[i][j]);
        }
    }
#pragma unroll
    for (int e = 0; e < 2; e++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], x));
            mx2[e] = fmaxf(mx2[e], __shfl_xor_sync(0xffffffffu, mx2[e], x));
        }
    float corr2[2];
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float mn = fmaxf(m[e], mx[e]);  // finite: token `base` is valid for every head
        float ps = 0.f;
#pragma unroll
        for (int i = 0; i < T2; i++) ps += exp2f(p[i][e] - mn) + exp2f(p[i][e + 2] - mn);  // p = -inf -> 0
        l[e] = l[e] * exp2f(m[e] - mn) + ps;  // m = -inf -> 0
        m[e] = mn;
        float mn2 = fmaxf(m2[e], mx2[e]);
        corr2[e] = mn2 == -INFINITY ? 1.f : exp2f(m2[e] - mn2);
#pragma unroll
        for (int i = 0; i < T2; i++) {
            q2[i][e] = mn2 == -INFINITY ? 0.f : exp2f(q2[i][e] - mn2);
            q2[i][e + 2] = mn2 == -INFINITY ? 0.f : exp2f(q2[i][e + 2] - mn2);
        }
        moved |= mn2 != m2[e];
        m2[e] = mn2;
    }
    if (__any_sync(0xffffffffu, moved)) {  // most steps of a long context leave every frame where it was
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int w = 0; w < 4; w++) {
                o[c][w][0] *= corr2[0];
                o[c][w][1] *= corr2[1];
                o[c][w][2] *= corr2[0];
                o[c][w][3] *= corr2[1];
            }
    }
#pragma unroll
    for (int i = 0; i < T2; i++) {
        // P^T as the B operand: lane (g, t) needs tokens 2t, 2t + 1 (and + 8) of head g
        uint32_t pb0 = pd_k_movmatrix_trans(pd_k_pack2_f16(q2[i][0], q2[i][1]));
        uint32_t pb1 = pd_k_movmatrix_trans(pd_k_pack2_f16(q2[i][2], q2[i][3]));
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int w = 0; w < 4; w++) {
                // units (2 dims of one token) -> tokens 2t, 2t + 1 of one dim pair -> bytes (tok 2t, tok 2t + 1) per dim
                uint32_t t0 = pd_k_prmt(pd_k_movmatrix_trans(pd_k_u4_get(r[i]->v[0][c], w)), 0x3120u);
                uint32_t t1 = pd_k_prmt(pd_k_movmatrix_trans(pd_k_u4_get(r[i]->v[1][c], w)), 0x3120u);
                pd_k_mma_f16(o[c][w], pd_k_e4m3x2_f16x2(t0), pd_k_e4m3x2_f16x2_hi(t0), pd_k_e4m3x2_f16x2(t1),
                             pd_k_e4m3x2_f16x2_hi(t1), pb0, pb1);
            }
    }
}

template <int HD, int GM, int W, int DEPTH, int T2>
static __global__ void __launch_bounds__(W * 32, W == 4 ? 2 : 1)
    k_attn_decode_f8s(const __nv_bfloat16 *q, const void *kc_, const void *vc_, __nv_bfloat16 *out,
                      const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                      const int32_t *bt_indices, int H, int n_kv, int bs, int q_stride, float scale_log2, int part,
                      int n_splits, float *ws, int *cnt, size_t rb, int n_new) {
    constexpr int NC = HD / 64, STEP = W * 16 * T2;  // a warp's step: T2 tiles of 16 tokens
    __shared__ float red[W][GM][HD + 2];
    const uint8_t *kc = (const uint8_t *)kc_, *vc = (const uint8_t *)vc_;
    pd_k_pdl_trigger();
    int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    int q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
    int kv_len = kv_lens[s];
    const int32_t *bt = bt_indices + bt_indptr[s];
    int k_begin = split * part, k_end = min(kv_len, k_begin + part);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bool live = q_len == 1 && k_begin < kv_len;
    int first = k_begin + warp * 16 * T2;
    // slots of the first DEPTH steps, then (nx) of the step loaded next; in the loop each step looks
    // up the one after, so a lookup's latency never delays the loads it feeds
    int slot[DEPTH][T2][2], nx[T2][2];
#pragma unroll
    for (int i = 0; i < T2; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
#pragma unroll
            for (int d = 0; d < DEPTH; d++)
                slot[d][i][hh] = live ? pd_k_dec_slot(bt, first + d * STEP + 16 * i + hh * 8 + g, k_end, bs) : -1;
            nx[i][hh] = live ? pd_k_dec_slot(bt, first + DEPTH * STEP + 16 * i + hh * 8 + g, k_end, bs) : -1;
        }
    pd_k_pdl_wait();
    if (!live) return;
    int n_sp = (kv_len + part - 1) / part;
    int G = H / n_kv;

    pd_k_f8_step_regs<HD> buf[DEPTH + 1][T2];
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
#pragma unroll
        for (int i = 0; i < T2; i++) pd_k_f8_load<HD>(buf[d][i], kc, vc, slot[d][i], n_kv, kvh, t, rb);

    // Q of head g at the load layout's dims, as f16 times a power of two
    uint32_t qh[NC][8];
    float qmax = 0.f;
    uint4 qr[NC][2];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            qr[c][h2] = g < G ? *(const uint4 *)(q + (size_t)q_begin * q_stride + (size_t)(kvh * G + g) * HD + c * 64 +
                                                 t * 16 + h2 * 8)
                              : make_uint4(0, 0, 0, 0);
            float f[8];
            pd_k_unpack8(qr[c][h2], f);
#pragma unroll
            for (int i = 0; i < 8; i++) qmax = fmaxf(qmax, fabsf(f[i]));
        }
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 1));
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 2));
    // |q| < 2^(ex + 1) -> times 2^(13 - ex); qmax = 0 (or not finite): times 1
    int ex = (int)((__float_as_uint(qmax) >> 23) & 0xff) - 127;
    int k2 = qmax > 0.f && ex < 128 ? min(max(13 - ex, -126), 127) : 0;
    float qmul = __uint_as_float((uint32_t)(k2 + 127) << 23);
    float slg = scale_log2 * __uint_as_float((uint32_t)(127 - k2) << 23);
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            float f[8];
            pd_k_unpack8(qr[c][h2], f);
#pragma unroll
            for (int i = 0; i < 4; i++) qh[c][h2 * 4 + i] = pd_k_pack2_f16(f[2 * i] * qmul, f[2 * i + 1] * qmul);
        }
    // this lane's score columns are heads 2t and 2t + 1
    const float sl[2] = {__shfl_sync(0xffffffffu, slg, 8 * t), __shfl_sync(0xffffffffu, slg, 8 * t + 4)};
    float o[NC][4][4];
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
        for (int w = 0; w < 4; w++) o[c][w][0] = o[c][w][1] = o[c][w][2] = o[c][w][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, m2[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    for (int b0 = first; b0 < k_end; b0 += (DEPTH + 1) * STEP) {
#pragma unroll
        for (int u = 0; u <= DEPTH; u++) {
            int base = b0 + u * STEP;
            if (base >= k_end) break;
#pragma unroll
            for (int i = 0; i < T2; i++) {
                int ns[2] = {nx[i][0], nx[i][1]};
                nx[i][0] = pd_k_dec_slot(bt, base + (DEPTH + 1) * STEP + 16 * i + g, k_end, bs);
                nx[i][1] = pd_k_dec_slot(bt, base + (DEPTH + 1) * STEP + 16 * i + 8 + g, k_end, bs);
                pd_k_f8_load<HD>(buf[(u + DEPTH) % (DEPTH + 1)][i], kc, vc, ns, n_kv, kvh, t, rb);
            }
            const pd_k_f8_step_regs<HD> *rr[T2];
#pragma unroll
            for (int i = 0; i < T2; i++) rr[i] = &buf[u][i];
            pd_k_f8s_step<HD, T2>(qh, rr, o, m, m2, l, base, k_end, g, sl);
        }
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], x);
        int h = 2 * t + e;
        if (h >= G) continue;
        float f2 = m2[e] == -INFINITY ? 0.f : exp2f(m2[e] - m[e]);  // the accumulator in m's frame
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int w = 0; w < 4; w++) {
                int d = c * 64 + (g >> 1) * 16 + 4 * w + 2 * (g & 1);
                red[warp][h][d] = o[c][w][e] * f2;
                red[warp][h][d + 1] = o[c][w][2 + e] * f2;
            }
        if (g == 0) {
            red[warp][h][HD] = m[e];
            red[warp][h][HD + 1] = l[e];
        }
    }
    __syncthreads();
    pd_k_dec_finish<HD, GM, W, W == 8>(red, out, ws, cnt, q_begin, s, kvh, G, H, split, n_sp, n_splits);
}

// ---- bf16 decode in the transposed form --------------------------------------------------------
//
// k_attn_decode_bt<HD, GM, W, DEPTH>: k_attn_decode_tc's grid, partitions and load layout (lane
// (g, t): tokens g and g + 8, dims i*32 + t*8 .. +8 for i < HD/32), computed the way
// k_attn_decode_f8s computes: S^T = K.Q^T (rows = the 16 tokens, cols = the heads) and O^T +=
// V^T.P^T (rows = 16 dims, cols = the heads), so no mma row is padding: 8 + 8 mma per step at
// HD 128 instead of 16 + 16, and half the accumulator registers, which pay for the next DEPTH
// steps' K and V in flight (the pipelined tc kernel holds only the next K). V^T's fragments are
// movmatrix of the loaded registers as is (a bf16 unit is one dim); P^T is two movmatrix of the
// packed weights. The default for the bf16 cache at head_dim 64/128 (PD_CUDA_ATTN_BT=0: k_attn_decode_tc):
// on an H200 it took B=1 ctx 32768 from 43.6 to 39.8 us, B=8 ctx 32768 from 297 to 261 us, B=64 ctx
// 4096 from 294 to 244 us, B=256 ctx 1024 from 302 to 253 us (docs/benchmarks.md).
// Lane (g, t) ends with o[i][rp][0..3] = O^T[dim i*32 + (g >> 1)*8 + 4rp + (g & 1) (+ 2 for
// [2], [3])][head 2t ([0], [2]) or 2t + 1 ([1], [3])].
template <int HD>
struct pd_k_bt_step_regs {
    uint4 k[2][HD / 32], v[2][HD / 32];
};

template <int HD>
static __device__ __forceinline__ void pd_k_bt_load(pd_k_bt_step_regs<HD> &r, const __nv_bfloat16 *kc,
                                                    const __nv_bfloat16 *vc, const int (&slot)[2], int n_kv, int kvh,
                                                    int t) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        if (slot[hh] >= 0) {
            size_t off = ((size_t)slot[hh] * n_kv + kvh) * HD + t * 8;
#pragma unroll
            for (int i = 0; i < HD / 32; i++) {
                r.k[hh][i] = __ldg((const uint4 *)(kc + off + i * 32));
                r.v[hh][i] = __ldg((const uint4 *)(vc + off + i * 32));
            }
        } else {
#pragma unroll
            for (int i = 0; i < HD / 32; i++) r.k[hh][i] = r.v[hh][i] = make_uint4(0, 0, 0, 0);
        }
    }
}

// The rows of pd_k_bt_load flagged late (with a slot), over what an early load left there.
template <int HD>
static __device__ __forceinline__ void pd_k_bt_load_late(pd_k_bt_step_regs<HD> &r, const __nv_bfloat16 *kc,
                                                         const __nv_bfloat16 *vc, const int (&slot)[2],
                                                         const bool (&late)[2], int n_kv, int kvh, int t) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        if (late[hh] && slot[hh] >= 0) {
            size_t off = ((size_t)slot[hh] * n_kv + kvh) * HD + t * 8;
#pragma unroll
            for (int i = 0; i < HD / 32; i++) {
                r.k[hh][i] = __ldg((const uint4 *)(kc + off + i * 32));
                r.v[hh][i] = __ldg((const uint4 *)(vc + off + i * 32));
            }
        }
    }
}

template <int HD>
static __device__ __forceinline__ void pd_k_bt_step(const uint4 (&qf)[HD / 32], const pd_k_bt_step_regs<HD> &r,
                                                    float (&o)[HD / 32][2][4], float (&m)[2], float (&l)[2], int base,
                                                    int k_end, int g, float scale_log2) {
    constexpr int NI = HD / 32;
    float sa[2][4];
#pragma unroll
    for (int a = 0; a < 2; a++) sa[a][0] = sa[a][1] = sa[a][2] = sa[a][3] = 0.f;
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            uint32_t a[4] = {pd_k_u4_get(r.k[0][i], 2 * h2), pd_k_u4_get(r.k[1][i], 2 * h2),
                             pd_k_u4_get(r.k[0][i], 2 * h2 + 1), pd_k_u4_get(r.k[1][i], 2 * h2 + 1)};
            pd_k_mma_bf16(sa[h2], a, pd_k_u4_get(qf[i], 2 * h2), pd_k_u4_get(qf[i], 2 * h2 + 1));
        }
    bool ok[2] = {base + g < k_end, base + 8 + g < k_end};
    float p[4], mx[2];
#pragma unroll
    for (int j = 0; j < 4; j++) p[j] = ok[j >> 1] ? (sa[0][j] + sa[1][j]) * scale_log2 : -INFINITY;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        mx[e] = fmaxf(p[e], p[e + 2]);
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], x));
    }
    float corr[2];
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float mn = fmaxf(m[e], mx[e]);  // finite: token `base` is valid for every head
        corr[e] = exp2f(m[e] - mn);     // m = -inf -> 0
        p[e] = exp2f(p[e] - mn);        // -inf -> 0
        p[e + 2] = exp2f(p[e + 2] - mn);
        l[e] = l[e] * corr[e] + p[e] + p[e + 2];
        moved |= mn != m[e];
        m[e] = mn;
    }
    if (__any_sync(0xffffffffu, moved)) {  // most steps of a long context leave every max where it was
#pragma unroll
        for (int i = 0; i < NI; i++)
#pragma unroll
            for (int rp = 0; rp < 2; rp++) {
                o[i][rp][0] *= corr[0];
                o[i][rp][1] *= corr[1];
                o[i][rp][2] *= corr[0];
                o[i][rp][3] *= corr[1];
            }
    }
    uint32_t pb0 = pd_k_movmatrix_trans(pd_k_pack2(p[0], p[1]));
    uint32_t pb1 = pd_k_movmatrix_trans(pd_k_pack2(p[2], p[3]));
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int rp = 0; rp < 2; rp++) {
            uint32_t a[4] = {pd_k_movmatrix_trans(pd_k_u4_get(r.v[0][i], 2 * rp)),
                             pd_k_movmatrix_trans(pd_k_u4_get(r.v[0][i], 2 * rp + 1)),
                             pd_k_movmatrix_trans(pd_k_u4_get(r.v[1][i], 2 * rp)),
                             pd_k_movmatrix_trans(pd_k_u4_get(r.v[1][i], 2 * rp + 1))};
            pd_k_mma_bf16(o[i][rp], a, pb0, pb1);
        }
}

template <int HD, int GM, int W, int DEPTH>
static __global__ void __launch_bounds__(W * 32, W == 4 ? 2 : 1)
    k_attn_decode_bt(const __nv_bfloat16 *q, const void *kc_, const void *vc_, __nv_bfloat16 *out,
                     const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                     const int32_t *bt_indices, int H, int n_kv, int bs, int q_stride, float scale_log2, int part,
                     int n_splits, float *ws, int *cnt, size_t rb, int n_new) {
    constexpr int NI = HD / 32, STEP = W * 16;
    __shared__ float red[W][GM][HD + 2];
    const __nv_bfloat16 *kc = (const __nv_bfloat16 *)kc_, *vc = (const __nv_bfloat16 *)vc_;
    pd_k_pdl_trigger();
    int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    int q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
    int kv_len = kv_lens[s];
    const int32_t *bt = bt_indices + bt_indptr[s];
    int k_begin = split * part, k_end = min(kv_len, k_begin + part);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bool live = q_len == 1 && k_begin < kv_len;
    int first = k_begin + warp * 16;
    int slot[DEPTH][2];
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            slot[d][hh] = live ? pd_k_dec_slot(bt, first + d * STEP + hh * 8 + g, k_end, bs) : -1;
    // the slots of the step loaded next; in the loop, each step looks up the one after (a lookup's
    // latency then never delays the loads it feeds)
    int nx[2] = {live ? pd_k_dec_slot(bt, first + DEPTH * STEP + g, k_end, bs) : -1,
                 live ? pd_k_dec_slot(bt, first + DEPTH * STEP + 8 + g, k_end, bs) : -1};
    // Rows below `stable` are not written by this step's kernels (n_new > 0: attention.cuh), so the
    // first steps' K and V of those rows are loaded before the wait, during the previous kernel;
    // the rest (this step's new rows) after it. Block-uniform.
    int stable = n_new > 0 ? kv_len - n_new : 0;
    bool early = live && stable > k_begin;
    pd_k_bt_step_regs<HD> buf[DEPTH + 1];
    if (early) {
#pragma unroll
        for (int d = 0; d < DEPTH; d++) {
            int pre[2] = {first + d * STEP + g < stable ? slot[d][0] : -1, first + d * STEP + 8 + g < stable ? slot[d][1] : -1};
            pd_k_bt_load<HD>(buf[d], kc, vc, pre, n_kv, kvh, t);
        }
    }
    pd_k_pdl_wait();
    if (!live) return;
    int n_sp = (kv_len + part - 1) / part;
    int G = H / n_kv;

#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        if (early) {
            bool late[2] = {first + d * STEP + g >= stable, first + d * STEP + 8 + g >= stable};
            pd_k_bt_load_late<HD>(buf[d], kc, vc, slot[d], late, n_kv, kvh, t);
        } else {
            pd_k_bt_load<HD>(buf[d], kc, vc, slot[d], n_kv, kvh, t);
        }
    }
    uint4 qf[NI];
#pragma unroll
    for (int i = 0; i < NI; i++)
        qf[i] = g < G ? *(const uint4 *)(q + (size_t)q_begin * q_stride + (size_t)(kvh * G + g) * HD + i * 32 + t * 8)
                      : make_uint4(0, 0, 0, 0);
    float o[NI][2][4];
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int rp = 0; rp < 2; rp++) o[i][rp][0] = o[i][rp][1] = o[i][rp][2] = o[i][rp][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    for (int b0 = first; b0 < k_end; b0 += (DEPTH + 1) * STEP) {
#pragma unroll
        for (int u = 0; u <= DEPTH; u++) {
            int base = b0 + u * STEP;
            if (base >= k_end) break;
            int ns[2] = {nx[0], nx[1]};
            nx[0] = pd_k_dec_slot(bt, base + (DEPTH + 1) * STEP + g, k_end, bs);
            nx[1] = pd_k_dec_slot(bt, base + (DEPTH + 1) * STEP + 8 + g, k_end, bs);
            pd_k_bt_load<HD>(buf[(u + DEPTH) % (DEPTH + 1)], kc, vc, ns, n_kv, kvh, t);
            pd_k_bt_step<HD>(qf, buf[u], o, m, l, base, k_end, g, scale_log2);
        }
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], x);
        int h = 2 * t + e;
        if (h >= G) continue;
#pragma unroll
        for (int i = 0; i < NI; i++)
#pragma unroll
            for (int rp = 0; rp < 2; rp++) {
                int d = i * 32 + (g >> 1) * 8 + 4 * rp + (g & 1);
                red[warp][h][d] = o[i][rp][e];
                red[warp][h][d + 2] = o[i][rp][2 + e];
            }
        if (g == 0) {
            red[warp][h][HD] = m[e];
            red[warp][h][HD + 1] = l[e];
        }
    }
    __syncthreads();
    pd_k_dec_finish<HD, GM, W, W == 8>(red, out, ws, cnt, q_begin, s, kvh, G, H, split, n_sp, n_splits);
}

template <int HD>
static __global__ void k_attn_combine(__nv_bfloat16 *out, const int32_t *q_indptr, const int32_t *kv_lens, int H,
                                      int part, int n_splits, const float *ws) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int s = blockIdx.x, h = blockIdx.y;
    int q_begin = q_indptr[s];
    if (q_indptr[s + 1] - q_begin != 1) return;
    int n_sp = (kv_lens[s] + part - 1) / part;
    if (n_sp <= 1) return;
    const float *w0 = ws + (size_t)(s * H + h) * n_splits * (HD + 1);
    float mx = -INFINITY;
    for (int i = 0; i < n_sp; i++) mx = fmaxf(mx, w0[(size_t)i * (HD + 1) + HD]);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int i = 0; i < n_sp; i++) {
            float f = exp2f(w0[(size_t)i * (HD + 1) + HD] - mx);
            num += f * w0[(size_t)i * (HD + 1) + d];
            den += f;
        }
        out[(size_t)q_begin * H * HD + (size_t)h * HD + d] = __float2bfloat16(num / den);
    }
}

// ---- launchers -------------------------------------------------------------------------------

extern "C" int pd_cuda_attention_supported(int head_dim, int n_heads, int n_kv_heads) {
    if (head_dim != 32 && head_dim != 64 && head_dim != 128) return 0;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads) return 0;
    return n_heads / n_kv_heads <= 8;
}

extern "C" size_t pd_cuda_attention_workspace_bytes(int n_tokens, int n_seqs, int n_heads, int n_kv_heads,
                                                    int head_dim, int max_kv_len) {
    int part = pd_k_dec_part(n_seqs, n_kv_heads, max_kv_len);
    int n_splits = (max_kv_len + part - 1) / part;
    if (n_splits <= 1) return 0;
    return (size_t)n_seqs * n_heads * n_splits * (head_dim + 1) * sizeof(float);
}

extern "C" size_t pd_cuda_attention_counter_bytes(int n_seqs, int n_kv_heads, int head_dim, int max_kv_len) {
    int part = pd_k_dec_part(n_seqs, n_kv_heads, max_kv_len);
    return (max_kv_len + part - 1) / part <= 1 ? 0 : (size_t)n_seqs * n_kv_heads * sizeof(int);
}

template <int HD, bool F8>
static void pd_k_attn_launch_prefill(const pd_attention_kparams *p, cudaStream_t s) {
    if (pd_cuda_attn_prefill_fa3(p, s)) return;  // sm_90a wgmma kernel (attention_prefill.cu) when it covers p
    int n_q_tiles = (p->max_q_len + PD_K_ATT_BQ - 1) / PD_K_ATT_BQ;
    size_t smem = (size_t)(PD_K_ATT_BQ + 4 * PD_K_ATT_BKV_OF(HD)) * (HD + 8) * 2;
    static bool attr_set = false;  // per instantiation; the first launch raises the smem limit
    if (!attr_set) {
        cudaFuncSetAttribute(k_attn_prefill<HD, F8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        attr_set = true;
    }
    dim3 grid(p->n_seqs * n_q_tiles, p->n_heads);
    k_attn_prefill<HD, F8><<<grid, PD_K_ATT_WARPS * 32, smem, s>>>(
        (const __nv_bfloat16 *)p->q, p->k_cache, p->v_cache, (__nv_bfloat16 *)p->out, p->q_indptr, p->kv_lens,
        p->bt_indptr, p->bt_indices, n_q_tiles, p->n_heads, p->n_kv_heads, p->block_size, p->q_stride,
        p->scale * PD_K_LOG2E, p->row_bytes);
}


// PD_CUDA_ATTN_TC=0 selects the CUDA-core decode kernel for every head_dim (measurement knob).
static bool pd_k_attn_tc_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_TC", &on);
}

// PD_CUDA_ATTN_PIPE=0: the bf16 tensor-core decode kernel loads K and V at the top of each step, as
// before the pipelined version (measurement knob).
static bool pd_k_attn_pipe_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_PIPE", &on);
}

// PD_CUDA_ATTN_F8S=0: the fp8 cache decodes with k_attn_decode_tc_f8 instead of the streaming
// k_attn_decode_f8s (measurement knob). PD_CUDA_ATTN_F8TILES=1|2: f8s steps of one 16-token tile
// with two steps of loads in flight, or (default) of two tiles sharing one softmax update with one
// step in flight; anything else is an error at first use. Measured on an H100 (docs/benchmarks.md):
// two tiles were best or level at every case but B=64 ctx 128; one tile with 1 or 3 steps in flight
// and a per-warp cp.async ring in shared memory (4 steps in flight at 140 registers) were slower.
static bool pd_k_attn_f8s_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_F8S", &on);
}

static int pd_k_attn_f8_tiles() {
    static int n = -1;
    if (n < 0) {
        const char *e = getenv("PD_CUDA_ATTN_F8TILES");
        if (!e || !*e) n = 2;
        else if (!strcmp(e, "1") || !strcmp(e, "2")) n = e[0] - '0';
        else {
            fprintf(stderr, "pdserve: PD_CUDA_ATTN_F8TILES=%s: expected 1 or 2\n", e);
            abort();
        }
    }
    return n;
}

// PD_CUDA_ATTN_BT=0: the bf16 cache decodes with k_attn_decode_tc (PD_CUDA_ATTN_PIPE applies) instead
// of k_attn_decode_bt (measurement knob).
static bool pd_k_attn_bt_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_BT", &on);
}

// PD_CUDA_ATTN_EARLY=0: the bf16 streaming decode kernel loads no K/V before its PDL wait, even
// where the caller says which rows this step writes (pd_attention_kparams.n_new; measurements).
static bool pd_k_attn_early_enabled() {
    static int on = -1;
    if (on < 0) on = pd_k_env_int("PD_CUDA_ATTN_EARLY", 1, 0, 1);
    return on != 0;
}

// PD_CUDA_ATTN_FOLD=0: split partials are always merged by k_attn_combine (measurement knob).
static bool pd_k_attn_fold_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_FOLD", &on);
}

typedef void (*pd_k_dec_kern)(const __nv_bfloat16 *, const void *, const void *, __nv_bfloat16 *, const int32_t *,
                              const int32_t *, const int32_t *, const int32_t *, int, int, int, int, float, int, int,
                              float *, int *, size_t, int);

template <int HD, int GM, bool F8>
static void pd_k_attn_launch_decode(const pd_attention_kparams *p, cudaStream_t s, int part, int n_splits) {
    dim3 grid(n_splits, p->n_kv_heads, p->n_seqs);
    // tensor cores for head_dim >= 64; 8 warps per block when the blocks do not fill the GPU
    bool tc = HD >= 64 && pd_k_attn_tc_enabled();
    long blocks = (long)n_splits * p->n_kv_heads * p->n_seqs;
    bool wide = tc && blocks <= pd_k_num_sms();
    bool fold = n_splits > 1 && wide && pd_k_attn_fold_enabled();  // only the 8-warp kernels merge
    pd_k_dec_kern kern = k_attn_decode<HD, GM, F8>;
    if constexpr (HD >= 64) {
        if (F8 && tc && pd_k_attn_f8s_enabled()) {
            if (pd_k_attn_f8_tiles() == 2) kern = wide ? k_attn_decode_f8s<HD, GM, 8, 1, 2> : k_attn_decode_f8s<HD, GM, 4, 1, 2>;
            else kern = wide ? k_attn_decode_f8s<HD, GM, 8, 2, 1> : k_attn_decode_f8s<HD, GM, 4, 2, 1>;
        } else if (F8) kern = wide ? k_attn_decode_tc_f8<HD, GM, 8> : tc ? k_attn_decode_tc_f8<HD, GM, 4> : kern;
        else if (tc && pd_k_attn_bt_enabled())
            kern = wide ? k_attn_decode_bt<HD, GM, 8, 1> : k_attn_decode_bt<HD, GM, 4, 1>;
        else if (pd_k_attn_pipe_enabled())
            kern = wide ? k_attn_decode_tc<HD, GM, 8, true> : tc ? k_attn_decode_tc<HD, GM, 4, true> : kern;
        else kern = wide ? k_attn_decode_tc<HD, GM, 8, false> : tc ? k_attn_decode_tc<HD, GM, 4, false> : kern;
    }
    pd_k_launch(kern, grid, dim3((wide ? 8 : 4) * 32), 0, s, (const __nv_bfloat16 *)p->q, p->k_cache, p->v_cache,
                (__nv_bfloat16 *)p->out, p->q_indptr, p->kv_lens, p->bt_indptr, p->bt_indices, p->n_heads,
                p->n_kv_heads, p->block_size, p->q_stride, p->scale * PD_K_LOG2E, part, n_splits, p->workspace,
                fold ? p->counters : (int *)0, p->row_bytes, pd_k_attn_early_enabled() ? p->n_new : 0);
    if (n_splits > 1 && !fold)
        pd_k_launch(k_attn_combine<HD>, dim3(p->n_seqs, p->n_heads), dim3(HD), 0, s, (__nv_bfloat16 *)p->out,
                    p->q_indptr, p->kv_lens, p->n_heads, part, n_splits, (const float *)p->workspace);
}

template <int HD, bool F8>
static void pd_k_attn_dispatch(const pd_attention_kparams *p, cudaStream_t s) {
    if (p->max_q_len > 1) {
        pd_k_attn_launch_prefill<HD, F8>(p, s);
        // One sequence of several query rows (its q_len is n_tokens): no decode row, so no decode
        // kernel, whose blocks would only wait for the prefill kernel (PDL) and return (a
        // prefill's every layer launched one; session 13, pf13).
        if (p->n_seqs == 1 && p->n_tokens > 1) return;
    }
    int part = pd_k_dec_part(p->n_seqs, p->n_kv_heads, p->max_kv_len);
    int n_splits = (p->max_kv_len + part - 1) / part;
    if (n_splits < 1) n_splits = 1;
    int G = p->n_heads / p->n_kv_heads;
    if (G == 1) pd_k_attn_launch_decode<HD, 1, F8>(p, s, part, n_splits);
    else if (G == 2) pd_k_attn_launch_decode<HD, 2, F8>(p, s, part, n_splits);
    else if (G <= 4) pd_k_attn_launch_decode<HD, 4, F8>(p, s, part, n_splits);
    else pd_k_attn_launch_decode<HD, 8, F8>(p, s, part, n_splits);
}

extern "C" void pd_cuda_attention(const pd_attention_kparams *p, cudaStream_t s) {
    if (p->n_tokens <= 0 || p->n_seqs <= 0) return;
    switch (p->head_dim * 2 + (p->kv_fp8 ? 1 : 0)) {
    case 64: pd_k_attn_dispatch<32, false>(p, s); break;
    case 128: pd_k_attn_dispatch<64, false>(p, s); break;
    case 256: pd_k_attn_dispatch<128, false>(p, s); break;
    case 65: pd_k_attn_dispatch<32, true>(p, s); break;
    case 129: pd_k_attn_dispatch<64, true>(p, s); break;
    case 257: pd_k_attn_dispatch<128, true>(p, s); break;
    default: break;  // pd_cuda_attention_supported() is checked by the caller
    }
}
