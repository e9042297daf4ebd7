// rope_kv.cu — RoPE (HF rotate_half layout: pairs (i, i + hd/2)) on the q and k heads of each
// qkv row, in place, then k and v of the token go to its paged-cache slot. One block per token:
// thread j handles rotation pair j of the (n_heads + n_kv_heads) * hd/2 pairs, then the v copy.
// The rotation is pd_k_rope_pair (common.cuh): transformers' bf16 rounding points unless
// PD_CUDA_HF_ROUNDING=0. Launched with PDL. The bf16 kernel splits a token's heads over several
// blocks (k_rope_kv).
#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/rope_kv.cuh"

// Block (t, y) rotates heads [y * hpb, (y + 1) * hpb) of token t (hpb: heads per block; the
// launcher splits a token's heads over gridDim.y blocks so that a small batch still fills the
// card); block y = 0 also copies v.
static __global__ void k_rope_kv(__nv_bfloat16 *qkv, const int32_t *positions, const float *inv_freq,
                                 const int32_t *slot_mapping, __nv_bfloat16 *kc, __nv_bfloat16 *vc, int H,
                                 int Hkv, int hd, float attn_scaling, int hf, int hpb, int early) {
    pd_k_pdl_trigger();
    // positions, slot_mapping (uploaded by the host before the step, never written by a kernel) and
    // the frequencies are read, and this thread's first angle computed, before the wait
    int t = blockIdx.x, half = hd / 2, h0 = blockIdx.y * hpb, h1 = min(h0 + hpb, H + Hkv);
    if (!early) pd_k_pdl_wait();
    float pos = (float)positions[t];
    int slot = slot_mapping[t], i0 = threadIdx.x % half;
    float sn0, cs0;
    pd_k_rope_cs(pos, inv_freq[i0], attn_scaling, hf, &sn0, &cs0);
    pd_k_pdl_wait();
    size_t row = (size_t)(H + 2 * Hkv) * hd;
    __nv_bfloat16 *r = qkv + (size_t)t * row;
    size_t kvw = (size_t)Hkv * hd;
    for (int j = threadIdx.x; j < (h1 - h0) * half; j += blockDim.x) {
        int h = h0 + j / half, i = j % half;
        __nv_bfloat16 *v = r + (size_t)h * hd;
        float f0, f1, sn = sn0, cs = cs0;
        if (i != i0) pd_k_rope_cs(pos, inv_freq[i], attn_scaling, hf, &sn, &cs);  // (blockDim % half != 0)
        pd_k_rope_apply(__bfloat162float(v[i]), __bfloat162float(v[i + half]), sn, cs, hf, &f0, &f1);
        __nv_bfloat16 y0 = __float2bfloat16(f0), y1 = __float2bfloat16(f1);
        v[i] = y0;
        v[i + half] = y1;
        if (h >= H && slot >= 0) {
            __nv_bfloat16 *kd = kc + (size_t)slot * kvw + (size_t)(h - H) * hd;
            kd[i] = y0;
            kd[i + half] = y1;
        }
    }
    if (slot >= 0 && blockIdx.y == 0) {
        const __nv_bfloat16 *vs = r + (size_t)(H + Hkv) * hd;
        __nv_bfloat16 *vd = vc + (size_t)slot * kvw;
        if (kvw % 8 == 0) {
            for (int j = threadIdx.x; j < (int)(kvw / 8); j += blockDim.x)
                ((uint4 *)vd)[j] = ((const uint4 *)vs)[j];
        } else {
            for (int j = threadIdx.x; j < (int)kvw; j += blockDim.x) vd[j] = vs[j];
        }
    }
}

// Large steps (prefill): one thread per 8 rotation pairs of one head (two 16-byte loads, the pairs
// (i .. i+7, i+half .. i+half+7)) or per 8 elements of the token's v heads (one 16-byte copy);
// a token's items are (H + Hkv) * half / 8 + Hkv * hd / 8, flattened over the whole step. The
// values are k_rope_kv's (the same pd_k_rope_cs / pd_k_rope_apply per pair). One thread per pair
// with 2-byte accesses ran an 8192-token Llama-3-8B step at 27% of the copy rate (H100, op_bench
// pfl: 257 us a layer); this moves 16 bytes per access. Needs half % 8 == 0 and 16-byte aligned
// rows (the launcher checks).
static __global__ void k_rope_kv_vec(__nv_bfloat16 *qkv, const int32_t *positions, const float *inv_freq,
                                     const int32_t *slot_mapping, __nv_bfloat16 *kc, __nv_bfloat16 *vc, int n_tokens,
                                     int H, int Hkv, int hd, float attn_scaling, int hf) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int half = hd / 2, cph = half / 8, n_rot = (H + Hkv) * cph, n_v = Hkv * hd / 8, per_tok = n_rot + n_v;
    int n = n_tokens * per_tok;  // < 2^31 (the launcher checks)
    size_t row = (size_t)(H + 2 * Hkv) * hd, kvw = (size_t)Hkv * hd;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
        int t = idx / per_tok, it = idx - t * per_tok;
        int slot = slot_mapping[t];
        __nv_bfloat16 *r = qkv + (size_t)t * row;
        if (it >= n_rot) {  // v: 8 elements to the cache
            if (slot >= 0) {
                int e = (it - n_rot) * 8;
                *(uint4 *)(vc + (size_t)slot * kvw + e) = *(const uint4 *)(r + (size_t)(H + Hkv) * hd + e);
            }
            continue;
        }
        int h = it / cph, i0 = (it - h * cph) * 8;
        __nv_bfloat16 *v = r + (size_t)h * hd;
        float pos = (float)positions[t], x0[8], x1[8], y0[8], y1[8];
        pd_k_unpack8(*(const uint4 *)(v + i0), x0);
        pd_k_unpack8(*(const uint4 *)(v + i0 + half), x1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float sn, cs;
            pd_k_rope_cs(pos, inv_freq[i0 + k], attn_scaling, hf, &sn, &cs);
            pd_k_rope_apply(x0[k], x1[k], sn, cs, hf, &y0[k], &y1[k]);
        }
        uint4 p0 = pd_k_pack8(y0), p1 = pd_k_pack8(y1);
        *(uint4 *)(v + i0) = p0;
        *(uint4 *)(v + i0 + half) = p1;
        if (h >= H && slot >= 0) {
            __nv_bfloat16 *kd = kc + (size_t)slot * kvw + (size_t)(h - H) * hd;
            *(uint4 *)(kd + i0) = p0;
            *(uint4 *)(kd + i0 + half) = p1;
        }
    }
}

// The fp8 cache (backend.h, PD_KV_FP8): the block rotates q and k in place as above, then one warp
// per (K or V, kv head) quantises the head: amax over head_dim (of the bf16 values the bf16 cache
// would hold), scale = amax / 448, q = e4m3(x * (448 / amax)) rounded to nearest even and saturated,
// exactly as the CPU backend's KV write computes it.
static __global__ void k_rope_kv_fp8(__nv_bfloat16 *qkv, const int32_t *positions, const float *inv_freq,
                                     const int32_t *slot_mapping, uint8_t *kc, uint8_t *vc, int H, int Hkv, int hd,
                                     float attn_scaling, int hf, size_t row_bytes) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int t = blockIdx.x, half = hd / 2;
    size_t row = (size_t)(H + 2 * Hkv) * hd;
    __nv_bfloat16 *r = qkv + (size_t)t * row;
    float pos = (float)positions[t];
    int slot = slot_mapping[t];
    for (int j = threadIdx.x; j < (H + Hkv) * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        __nv_bfloat16 *v = r + (size_t)h * hd;
        float f0, f1;
        pd_k_rope_pair(__bfloat162float(v[i]), __bfloat162float(v[i + half]), pos, inv_freq[i], attn_scaling, hf,
                       &f0, &f1);
        v[i] = __float2bfloat16(f0);
        v[i + half] = __float2bfloat16(f1);
    }
    if (slot < 0) return;
    __syncthreads();  // the rotated k heads (global, this block's writes) are visible to every warp
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int it = warp; it < 2 * Hkv; it += n_warps) {
        int is_v = it >= Hkv, kvh = it - is_v * Hkv;
        const __nv_bfloat16 *src = r + (size_t)(H + it) * hd;
        uint8_t *dst = (is_v ? vc : kc) + (size_t)slot * row_bytes;
        float amax = 0.f;
        for (int i = lane; i < hd; i += 32) amax = fmaxf(amax, fabsf(__bfloat162float(src[i])));
        amax = pd_k_warp_max(amax);
        // IEEE divisions (__fdiv_rn) and an unfused product, whatever --use_fast_math says: the
        // CPU backend computes the same values bit for bit.
        float inv = amax > 0.f ? __fdiv_rn(448.f, amax) : 0.f;
        for (int i = lane; i < hd; i += 32)
            dst[(size_t)kvh * hd + i] =
                __nv_cvt_float_to_fp8(__fmul_rn(__bfloat162float(src[i]), inv), __NV_SATFINITE, __NV_E4M3);
        if (lane == 0) ((float *)(dst + (size_t)Hkv * hd))[kvh] = __fdiv_rn(amax, 448.f);
    }
}

extern "C" void pd_cuda_rope_kv(const pd_rope_kv_kparams *p, cudaStream_t s) {
    if (p->n_tokens <= 0) return;
    int pairs = (p->n_heads + p->n_kv_heads) * p->head_dim / 2;
    int threads = pairs >= 512 ? 512 : ((pairs + 31) / 32) * 32;
    if (p->kv_fp8) {
        pd_k_launch(k_rope_kv_fp8, dim3(p->n_tokens), dim3(threads), 0, s, (__nv_bfloat16 *)p->qkv, p->positions,
                    p->inv_freq, p->slot_mapping, (uint8_t *)p->k_cache, (uint8_t *)p->v_cache, p->n_heads,
                    p->n_kv_heads, p->head_dim, p->attn_scaling, pd_k_hf_rounding(), p->row_bytes);
        return;
    }
    // Steps of at least PD_CUDA_ROPE_VEC_MIN tokens (default 256; 0: never) with 16-byte rows and
    // half % 8 == 0: k_rope_kv_vec.
    static int vec_min = -2;
    if (vec_min == -2) vec_min = pd_k_env_int("PD_CUDA_ROPE_VEC_MIN", 256, 0, 1 << 30);
    int hd = p->head_dim;
    bool aligned = ((uintptr_t)p->qkv | (uintptr_t)p->k_cache | (uintptr_t)p->v_cache) % 16 == 0;
    size_t n = (size_t)p->n_tokens * ((p->n_heads + p->n_kv_heads) * (hd / 16) + p->n_kv_heads * hd / 8);
    if (vec_min > 0 && p->n_tokens >= vec_min && hd % 16 == 0 && aligned && n < 0x7fff0000u) {
        size_t blocks = (n + 255) / 256;  // one item per thread
        pd_k_launch(k_rope_kv_vec, dim3((unsigned)blocks), dim3(256), 0, s, (__nv_bfloat16 *)p->qkv, p->positions,
                    p->inv_freq, p->slot_mapping, (__nv_bfloat16 *)p->k_cache, (__nv_bfloat16 *)p->v_cache,
                    p->n_tokens, p->n_heads, p->n_kv_heads, hd, p->attn_scaling, pd_k_hf_rounding());
        return;
    }
    // Heads split over blocks (PD_CUDA_ROPE_SPLIT=0: one block per token, every head): one pass of
    // the block's threads per block, so a 64-token batch runs 320 short blocks instead of 64 that
    // loop 5 times (Llama-3-8B: 40 rotated heads of 64 pairs).
    static int split_on = -1;
    int n_rot = p->n_heads + p->n_kv_heads, half = p->head_dim / 2;
    int hpb = pd_k_env_on("PD_CUDA_ROPE_SPLIT", &split_on) && half > 0 ? (threads / half > 0 ? threads / half : 1) : n_rot;
    int gy = (n_rot + hpb - 1) / hpb;
    pd_k_launch(k_rope_kv, dim3(p->n_tokens, gy), dim3(threads), 0, s, (__nv_bfloat16 *)p->qkv, p->positions,
                p->inv_freq, p->slot_mapping, (__nv_bfloat16 *)p->k_cache, (__nv_bfloat16 *)p->v_cache, p->n_heads,
                p->n_kv_heads, p->head_dim, p->attn_scaling, pd_k_hf_rounding(), hpb, pd_k_early_loads());
}
