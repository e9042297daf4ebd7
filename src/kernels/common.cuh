// common.cuh — small device helpers shared by the kernels: bf16 <-> f32 vectors of 8 (one 16-byte
// load), warp reductions, the mma.sync / ldmatrix / cp.async wrappers used by attention, and
// programmatic dependent launch (PDL).
// Device-only: included by .cu files, never by the C shim.
//
// PDL (sm_90): a kernel launched with pd_k_launch may start while the kernel before it in the
// stream is still running. Contract for every kernel launched that way:
//   * it calls pd_k_pdl_wait() in every thread before it reads anything an earlier kernel wrote,
//     before it writes anything an earlier kernel reads or writes, and before it exits (a grid
//     whose threads all skipped the wait could complete before its predecessor, breaking the
//     transitive ordering that later kernels rely on); loads of data no kernel writes (weights)
//     may be issued before the wait — that is the point: they overlap the previous kernel's tail;
//   * it calls pd_k_pdl_trigger() as early as it likes (the dependents still wait for this grid
//     to complete before they read its output).
// PD_CUDA_PDL=0 launches everything plainly (the wait and trigger are then no-ops).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PD_K_WARP 32

// 8 bf16 packed in 16 bytes.
struct pd_k_bf16x8 {
    uint4 u;
};

// 16-byte streaming load of read-only data (weights): not kept in L1, L2 fetches 256-byte sectors
// (the skinny GEMM kernels).
static __device__ __forceinline__ uint4 pd_k_ld_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

static __device__ __forceinline__ void pd_k_unpack8(uint4 u, float f[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

static __device__ __forceinline__ uint32_t pd_k_pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // .x = a (low half), .y = b
    return *reinterpret_cast<uint32_t *>(&h);
}

static __device__ __forceinline__ uint4 pd_k_pack8(const float f[8]) {
    uint4 u;
    u.x = pd_k_pack2(f[0], f[1]);
    u.y = pd_k_pack2(f[2], f[3]);
    u.z = pd_k_pack2(f[4], f[5]);
    u.w = pd_k_pack2(f[6], f[7]);
    return u;
}

static __device__ __forceinline__ float pd_k_bf2f(__nv_bfloat16 h) { return __bfloat162float(h); }

static __device__ __forceinline__ float pd_k_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float pd_k_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, <= 1024). `red` holds >= 32 floats.
static __device__ __forceinline__ float pd_k_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = pd_k_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : 0.0f;
    return pd_k_warp_sum(v);
}

// ---- tensor-core helpers (sm_80+) --------------------------------------------------------------

static __device__ __forceinline__ uint32_t pd_k_smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async global->shared copy; zero-fills when !valid.
static __device__ __forceinline__ void pd_k_cp_async16(void *smem, const void *gmem, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(pd_k_smem_u32(smem)), "l"(gmem), "r"(n));
}
static __device__ __forceinline__ void pd_k_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
static __device__ __forceinline__ void pd_k_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void pd_k_ldmatrix_x4(uint32_t r[4], const void *smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pd_k_smem_u32(smem)));
}
static __device__ __forceinline__ void pd_k_ldmatrix_x4_trans(uint32_t r[4], const void *smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pd_k_smem_u32(smem)));
}

// d (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col)
static __device__ __forceinline__ void pd_k_mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- programmatic dependent launch -------------------------------------------------------------

static __device__ __forceinline__ void pd_k_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void pd_k_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The measurement knobs: false when environment variable `name` is "0", else true. Read once per
// process into *cache (-1 before; a benign race on first use).
static inline bool pd_k_env_on(const char *name, int *cache) {
    if (*cache < 0) {
        const char *e = getenv(name);
        *cache = (e && !strcmp(e, "0")) ? 0 : 1;
    }
    return *cache != 0;
}

// An integer knob in [lo, hi] (dflt when unset or empty); anything else is a clear error. (base's
// pd_env_int, for the .cu files: base.h is C, not C++.)
static inline int pd_k_env_int(const char *name, int dflt, int lo, int hi) {
    const char *e = getenv(name);
    if (!e || !*e) return dflt;
    char *end = NULL;
    long v = strtol(e, &end, 10);
    if (*end || v < lo || v > hi) {
        fprintf(stderr, "pdserve: %s=%s: expected an integer in [%d, %d]\n", name, e, lo, hi);
        abort();
    }
    return (int)v;
}

// PD_CUDA_PDL=0 turns PDL off.
static inline bool pd_k_pdl_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_PDL", &on);
}

// Whether rmsnorm and rope_kv read what no kernel writes (the norm weight; positions, slots and
// frequencies) before their PDL wait; PD_CUDA_EARLY_LOADS=0: after it (measurements).
static inline int pd_k_early_loads() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_EARLY_LOADS", &on);
}

// Launches kern<<<grid, block, smem, s>>>(args...) with the programmatic-stream-serialization
// attribute when PDL is on. Errors surface through cudaGetLastError (the caller checks).
template <typename... KArgs, typename... Args>
static inline void pd_k_launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                               Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pd_k_pdl_enabled() ? 1 : 0;
    (void)cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}

// ---- bf16 rounding points -------------------------------------------------------------------

// The value x would have after a store to bf16 and a load back.
static __device__ __forceinline__ float pd_k_bf16r(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Element o of a GEMM's output from its f32 sum v (bias included): f32 or bf16 out, overwritten
// or accumulated (the sum rounded once); residual: out = bf16(out + bf16(v)), as two bf16 ops do.
static __device__ __forceinline__ void pd_k_gemm_out(void *out, size_t o, float v, int out_f32, int accumulate) {
    if (out_f32) {
        float *of = (float *)out;
        of[o] = accumulate ? of[o] + v : v;
    } else {
        __nv_bfloat16 *ob = (__nv_bfloat16 *)out;
        ob[o] = __float2bfloat16(accumulate ? __bfloat162float(ob[o]) + v : v);
    }
}
static __device__ __forceinline__ void pd_k_gemm_out_residual(void *out, size_t o, float v) {
    __nv_bfloat16 *ob = (__nv_bfloat16 *)out;
    ob[o] = __float2bfloat16(__bfloat162float(ob[o]) + pd_k_bf16r(v));
}

// Whether the elementwise kernels round where transformers' bf16 modules round (a product's
// operands and each intermediate tensor; see backend.h), or only their final result.
// PD_CUDA_HF_ROUNDING=0 selects the latter (measurements only).
static inline int pd_k_hf_rounding() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_HF_ROUNDING", &on);
}

// SiLU as the SwiGLU kernels compute it (silu_mul.cu and the skinny GEMM's glu epilogue).
static __device__ __forceinline__ float pd_k_silu(float g) { return g / (1.0f + __expf(-g)); }

// ---- RoPE ------------------------------------------------------------------------------------

// sin/cos of angle a after reduction mod 2*pi, so that long positions keep full accuracy under
// --use_fast_math.
static __device__ __forceinline__ void pd_k_sincos(float a, float *s, float *c) {
    const float two_pi_hi = 6.28318548202514648f, two_pi_lo = -1.7484555314695172e-7f;
    float k = rintf(a * 0.159154943091895336f);
    float r = fmaf(-k, two_pi_hi, a);
    r = fmaf(-k, two_pi_lo, r);
    __sincosf(r, s, c);
}

// Rotation of the pair (x0, x1) = (x[i], x[i + hd/2]) at position pos with frequency inv_freq[i]
// (the angle pos * inv_freq in fp32, as transformers computes it). hf: cos and sin rounded to bf16
// and each product and the sum rounded, as transformers' apply_rotary_pos_emb does in bf16 (the
// caller rounds the results when it stores them).
// In two halves (rope_kv.cu computes the angle's sin and cos before its PDL wait): the scaled
// (hf: rounded) sin and cos, then the rotation.
static __device__ __forceinline__ void pd_k_rope_cs(float pos, float inv_freq, float scaling, int hf, float *sn,
                                                    float *cs) {
    pd_k_sincos(pos * inv_freq, sn, cs);
    *cs *= scaling;
    *sn *= scaling;
    if (hf) {
        *cs = pd_k_bf16r(*cs);
        *sn = pd_k_bf16r(*sn);
    }
}
static __device__ __forceinline__ void pd_k_rope_apply(float x0, float x1, float sn, float cs, int hf, float *y0,
                                                       float *y1) {
    if (hf) {
        *y0 = pd_k_bf16r(x0 * cs) - pd_k_bf16r(x1 * sn);
        *y1 = pd_k_bf16r(x1 * cs) + pd_k_bf16r(x0 * sn);
    } else {
        *y0 = x0 * cs - x1 * sn;
        *y1 = x1 * cs + x0 * sn;
    }
}
static __device__ __forceinline__ void pd_k_rope_pair(float x0, float x1, float pos, float inv_freq, float scaling,
                                                      int hf, float *y0, float *y1) {
    float sn, cs;
    pd_k_rope_cs(pos, inv_freq, scaling, hf, &sn, &cs);
    pd_k_rope_apply(x0, x1, sn, cs, hf, y0, y1);
}

// SMs of the current device (cached per device id; grid sizing of the persistent-style kernels).
static inline int pd_k_num_sms() {
    static int cache[64];
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64) dev = 0;
    if (!cache[dev]) {
        int n = 0;
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
        cache[dev] = n > 0 ? n : 1;
    }
    return cache[dev];
}
