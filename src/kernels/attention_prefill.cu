// attention_prefill.cu — the sm_90a prefill attention kernel (FlashAttention-3 style): wgmma
// tensor-core instructions, a warp-specialised producer/consumer pipeline on mbarriers, and
// 128-byte-swizzled shared-memory tiles. Contract: attention.cuh (paged causal GQA attention over
// a mixed batch); this kernel takes the sequences with q_len > 1 of a bf16 cache with head_dim 64
// or 128, and pd_cuda_attn_prefill_fa3 says (by its return value) whether it launched, so the
// caller falls back to k_attn_prefill (attention.cu) for anything else (fp8 caches, head_dim 32).
//
// Block = 3 warpgroups (384 threads) for one (sequence, 128-row query tile, query head):
//   * warpgroup 0, the producer (setmaxnreg down to PD_FA_REG_P): cp.async of the Q tile and of
//     the K/V tiles of BKV = 128 positions, gathered through the page table (16-byte chunks, any
//     block_size; LKF, the default at head_dim 128: lane i loads page i of the tile and each row
//     takes its page by a shuffle; else a tile's lookups are issued together before its copies),
//     into a ring of PD_FA_STAGES stages. ARV (the default at head_dim 128): each thread's copies
//     arrive on the stage's "full" mbarrier (count 128) by cp.async.mbarrier.arrive when they land,
//     and the consumers issue fence.proxy.async after their wait (the tiles are read by wgmma
//     through the async proxy); otherwise each thread waits for its own copies one tile behind its
//     issue, fences and arrives, which put the next tile's issue on the consumers' critical path
//     (session 15: +11% at 8k). It refills a stage after both consumers arrived on its "empty"
//     mbarrier (count 256). PD_CUDA_FA3_TMA=1: whole pages come by TMA instead (one
//     64 x 1 x block_size box per page, column block and cache, expect_tx on the same barrier);
//     correct, but slower on an H100 (343 vs 396 TFLOP/s at 8k: 32 small boxes per 64 KB tile), so
//     it stays opt-in. PD_CUDA_FA3_TMA=2 (TMAH, head_dim 128): a tile in consecutive whole pages by
//     TMA as 4 tile-sized boxes, any other tile by cp.async (session 13; see pd_fa_flags).
//   * warpgroups 1 and 2, the consumers (setmaxnreg up to PD_FA_REG_C): 64 query rows each.
//     S = Q.K^T is wgmma m64n128k16 with both operands in shared memory (K-major descriptors);
//     the online softmax runs on the accumulator registers (base-2 exponentials, scale * log2(e)
//     folded into one FFMA per score, causal mask only on tiles that cross the diagonal, tiles past
//     the diagonal skipped); P is rounded to bf16 in registers (the accumulator layout of S is the
//     A-operand layout of the next wgmma) and O += P.V is wgmma with A from registers and V from
//     shared memory as an N-major (transposed) operand: two m64n64k16 per k-step at head_dim 128
//     (measured faster than one m64n128k16; PD_CUDA_FA3_VN64=0 for the latter). The two consumers
//     take turns issuing their S products (ping-pong on named barriers; PD_CUDA_FA3_PP=0: off), so
//     one's softmax overlaps the other's tensor-core work. Each consumer also overlaps its own work
//     (OVL, FA3's intra-warpgroup pipelining; PD_CUDA_FA3_OVL=0: off): a turn issues S of tile j and
//     P.V of tile j - 1 as two commit groups and runs tile j's softmax while that P.V runs; O moves to
//     the new running max at the end of the turn, after that P.V (RSE, session 15: the rescale had
//     sat inside the ping-pong turn, between the handshake and the wgmmas). Its loops
//     are split (first tile, overlapped turns, last P.V, tiles past the warpgroup's rows) so that no
//     wgmma, fence, commit or wait sits under a condition: ptxas serialises every wgmma of a kernel
//     (C7514-C7518 reports) otherwise, as it did for session 10-11's OVL (measured slower then); the
//     Makefile's WERROR=1 fails the build on such a report. At head_dim 64 K and V of a stage have
//     separate barriers (KVS): K is released after S, V after P.V, so K is refilled a turn earlier.
// Shared-memory tiles are rows of HD bf16 split into 64-element (128-byte) column blocks; a
// column block holds 128 rows of 128 bytes, and 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) of its row (the 128-byte swizzle, which wgmma applies on address bits, so every
// tile starts 1024-byte aligned). Q | K[STAGES] | V[STAGES] | mbarriers.
//   HD=128: 32 KB per tile, 3 stages: 225 KB; HD=64: 16 KB per tile, 4 stages: 145 KB.
// Grid: one block per (query tile, sequence, head) with the query tile slowest and reversed, so
// the longest tiles (most K/V tiles under the causal mask) start first, and the heads sharing a
// kv head are neighbours (their K/V tiles meet in L2). PD_CUDA_FA3_PERS=1 (measurements): one
// block per SM walking those work items, the ring running on across them.
//
// PD_CUDA_ATTN_PREFILL=0 selects k_attn_prefill everywhere (A/B knob); the PD_CUDA_FA3_* knobs are
// listed at pd_fa_flags. Numbers: docs/benchmarks.md, tools/gpu/NOTES.md (session 10, "fa3").
#include <cuda.h>  // CUtensorMap (the encoder comes through the runtime's driver entry point)
#include <cudaTypedefs.h>
#include <math.h>
#include <stdio.h>

#include "kernels/attention_prefill.cuh"
#include "kernels/common.cuh"

#define PD_FA_BQ 128
#define PD_FA_BKV 128
#define PD_FA_THREADS 384
#define PD_FA_REG_P 56
#define PD_FA_REG_C 224
#define PD_FA_LOG2E 1.4426950408889634f
#define PD_FA_STAGES(HD) ((HD) == 64 ? 4 : 3)

template <int HD>
struct pd_fa_cfg {
    static constexpr int TILE = PD_FA_BKV * HD * 2;  // bytes of a Q, K or V tile (BQ == BKV)
    static constexpr int CB = PD_FA_BKV * 128;       // bytes of one 64-element column block
    static constexpr int ST = PD_FA_STAGES(HD);
    static constexpr int SMEM = 1024 + TILE * (1 + 2 * ST) + 8 * (4 * ST + 2);  // KVS: 4 barriers a stage; Q: 2
};

// ---- PTX wrappers (sm_90a) ---------------------------------------------------------------------

static __device__ __forceinline__ void pd_fa_cp16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ void pd_fa_mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void pd_fa_mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void pd_fa_mbar_wait(uint32_t bar, int parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// Arrives on bar (one of its expected arrivals: .noinc) when every cp.async this thread issued so
// far has landed, without waiting for them here.
static __device__ __forceinline__ void pd_fa_cp_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void pd_fa_fence_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
static __device__ __forceinline__ void pd_fa_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void pd_fa_wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void pd_fa_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Adds tx bytes the current phase of bar waits for (no arrival).
static __device__ __forceinline__ void pd_fa_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One TMA box (64 elements x 1 kv head x block_size slots, 128-byte swizzle) to shared memory, completing
// its bytes on bar.
static __device__ __forceinline__ void pd_fa_tma3(uint32_t dst, const CUtensorMap *tm, int c0, int c1, int c2,
                                                  uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"((uint64_t)tm), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// Named barriers 1 and 2 over the two consumer warpgroups (256 threads).
static __device__ __forceinline__ void pd_fa_bar_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
static __device__ __forceinline__ void pd_fa_bar_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}
// Keeps the compiler from moving accumulator registers across the asynchronous wgmma window.
template <int N>
static __device__ __forceinline__ void pd_fa_pin(float *d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for P's A-operand registers: keeps them live (not reused by the compiler) until the
// wait that ends the P.V reading them.
template <int N>
static __device__ __forceinline__ void pd_fa_pin_u(uint32_t (*a)[4]) {
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int k = 0; k < 4; k++) asm volatile("" : "+r"(a[i][k])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (16-byte units). K-major operands (Q, K): SBO = 1024 (8 rows of 128 bytes), LBO unused;
// the k16 steps inside a column block advance the start by 32 bytes. N-major V: SBO = 1024 (8 kv
// rows), LBO = the distance between 64-element column blocks.
static __device__ __forceinline__ uint64_t pd_fa_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}

// Byte offset of 16-byte chunk c of row r in a swizzled tile of 128 rows.
static __device__ __forceinline__ uint32_t pd_fa_swz(int r, int c) {
    return (uint32_t)((c >> 3) * (PD_FA_BKV * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// ---- wgmma (generated once: m64nNk16 bf16 -> f32) ---------------------------------------------
// D[64 x 128] = (scale_d ? D : 0) + A * B; A and B from shared memory, both K-major.
static __device__ __forceinline__ void pd_fa_wgmma_ss_n128(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 64] += A * B; A (64 x 16) from registers, B (16 x 64) from shared memory, N-major.
static __device__ __forceinline__ void pd_fa_wgmma_rs_n64(float *d, const uint32_t *a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// D[64 x 128] += A * B; A (64 x 16) from registers, B (16 x 128) from shared memory, N-major.
static __device__ __forceinline__ void pd_fa_wgmma_rs_n128(float *d, const uint32_t *a, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}


// DSC (session 15): the same three wgmmas with the descriptors given as their low words; the high word
// (stride 1024 bytes, 128-byte swizzle) is the same for every operand here and joins inside the asm. The
// low word holds the start address >> 4 (14 bits: below 256 KB, so a k-step's offset never carries out)
// and the leading byte offset: one 32-bit add per k-step instead of 64-bit ones and register moves.
#define PD_FA_DHI 0x40000040u
static __device__ __forceinline__ uint32_t pd_fa_dlo(uint32_t addr, uint32_t lbo) {
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
static __device__ __forceinline__ void pd_fa_wgmma_ss_n128_lo(float *d, uint32_t la, uint32_t lb, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %66, 0;\nmov.b64 da, {%64, %67};\nmov.b64 db, {%65, %67};\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, da, db, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(la), "r"(lb), "r"(scale_d), "r"(PD_FA_DHI));
}
static __device__ __forceinline__ void pd_fa_wgmma_rs_n64_lo(float *d, const uint32_t *a, uint32_t lb) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %37, 0;\nmov.b64 db, {%36, %38};\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, db, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(lb), "r"(1), "r"(PD_FA_DHI));
}
static __device__ __forceinline__ void pd_fa_wgmma_rs_n128_lo(float *d, const uint32_t *a, uint32_t lb) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %69, 0;\nmov.b64 db, {%68, %70};\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, db, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(lb), "r"(1), "r"(PD_FA_DHI));
}

// ---- consumer pieces ---------------------------------------------------------------------------

#define PD_FA_VN64 1  // flags: P.V of head_dim 128 as two n64 wgmmas
#define PD_FA_PP 2    // the consumers' ping-pong
#define PD_FA_ROWP 4  // the first producer: one page-table load, then the copies, row after row
#define PD_FA_TMA 32  // whole pages by the tensor-memory accelerator (block_size 8..128 dividing 128)
#define PD_FA_OVL 64  // consumers overlap tile j's S = Q.K^T and softmax with tile j - 1's P.V
#define PD_FA_ARV 128  // the producer's copies arrive on "full" as they land (cp.async.mbarrier.arrive)
#define PD_FA_KVS 256  // with OVL: K and V of a stage on separate full / empty barriers
#define PD_FA_TMAH 512  // a tile in consecutive pages by TMA (one box per column block), else cp.async
#define PD_FA_RSC 1024  // with OVL: O rescaled only when a row of the warp changed its running max
#define PD_FA_MB 4096   // the causal mask in its own code path, taken only by tiles that cross the diagonal
#define PD_FA_RSE 8192  // with OVL: O rescaled at the end of its turn (after the wait for P.V), off the ping-pong's turn
#define PD_FA_PERS 32768  // persistent blocks (one per SM) over the work items, the ring running on across them
#define PD_FA_DSC 65536  // wgmma descriptors as 32-bit low words (the high word a constant), built before the handshake
#define PD_FA_LKF 16384  // the producer's page-table lookups: one load per lane and a shuffle per row (bs >= rows a pass)
// Diagnostics, compiled only with -DPD_FA3_DIAG (a separate op_bench build; the output is wrong):
#define PD_FA_NOLOAD 8   // the producer copies K/V into the ring's stages once, then none (the consumers alone)
#define PD_FA_NOMATH 16  // the consumers compute nothing (the producer's speed alone)
#define PD_FA_NOSYNC 2048  // nobody waits on the K/V ring's barriers (copies and math run uncoupled)

// Issues S = Q.K^T (HD / 16 wgmmas, no commit). qa: this warpgroup's 64 Q rows; kt: the K tile.
// The descriptors are built once per tile; each k-step adds its byte offset / 16 to the start-address
// field (14 bits: shared-memory addresses stay below 256 KB, so the sum never carries out of it).
// DSC: qa and kt are the descriptors' low words (pd_fa_dlo) instead of addresses.
template <int HD, bool DSC = false>
static __device__ __forceinline__ void pd_fa_issue_s(float *sc, uint32_t qa, uint32_t kt) {
    if constexpr (DSC) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t off = (kk >> 2) * (PD_FA_BKV * 128) + (kk & 3) * 32;
            pd_fa_wgmma_ss_n128_lo(sc, qa + (off >> 4), kt + (off >> 4), kk > 0);
        }
        return;
    }
    const uint64_t dq = pd_fa_desc(qa, 16), dk = pd_fa_desc(kt, 16);
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t off = (kk >> 2) * (PD_FA_BKV * 128) + (kk & 3) * 32;
        pd_fa_wgmma_ss_n128(sc, dq + (off >> 4), dk + (off >> 4), kk > 0);
    }
}

// Issues O += P.V (BKV / 16 k-steps, no commit).
// DSC: vt is the descriptor's low word (pd_fa_dlo(address, CB)).
template <int HD, bool VN64, bool DSC = false>
static __device__ __forceinline__ void pd_fa_issue_pv(float *o, const uint32_t (*pa)[4], uint32_t vt) {
    constexpr uint32_t CB = PD_FA_BKV * 128;
    if constexpr (DSC) {
#pragma unroll
        for (int kk = 0; kk < PD_FA_BKV / 16; kk++) {
            if constexpr (HD == 64) {
                pd_fa_wgmma_rs_n64_lo(o, pa[kk], vt + kk * (2048 >> 4));
            } else if constexpr (VN64) {
                pd_fa_wgmma_rs_n64_lo(o, pa[kk], vt + kk * (2048 >> 4));
                pd_fa_wgmma_rs_n64_lo(o + 32, pa[kk], vt + ((CB + kk * 2048) >> 4));
            } else {
                pd_fa_wgmma_rs_n128_lo(o, pa[kk], vt + kk * (2048 >> 4));
            }
        }
        return;
    }
    const uint64_t dv = pd_fa_desc(vt, CB);
#pragma unroll
    for (int kk = 0; kk < PD_FA_BKV / 16; kk++) {
        if constexpr (HD == 64) {
            pd_fa_wgmma_rs_n64(o, pa[kk], dv + kk * (2048 >> 4));
        } else if constexpr (VN64) {
            pd_fa_wgmma_rs_n64(o, pa[kk], dv + kk * (2048 >> 4));
            pd_fa_wgmma_rs_n64(o + 32, pa[kk], dv + ((CB + kk * 2048) >> 4));
        } else {
            pd_fa_wgmma_rs_n128(o, pa[kk], dv + kk * (2048 >> 4));
        }
    }
}

// The first half of both softmax forms: mask, row max, rescale factors; nb gets the exponent's bias.
// The max runs on the raw scores (scale_log2 > 0 keeps the order); m is in the scaled domain and
// each exponent is one FFMA: exp2(s * scale_log2 - m).
template <bool MASK>
static __device__ __forceinline__ void pd_fa_row_max(float *sc, float *m, float *l, float *corr, float *nb,
                                                     int kv0, const int *qpos, int t, float scale_log2) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < PD_FA_BKV / 8; nt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = sc[nt * 4 + i];
            if (MASK && kv0 + nt * 8 + 2 * t + (i & 1) > qpos[i >> 1]) v = -INFINITY;
            sc[nt * 4 + i] = v;
            mx[i >> 1] = fmaxf(mx[i >> 1], v);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        float mn = fmaxf(m[r], mx[r] * scale_log2);  // -inf only while every position so far is masked
        corr[r] = mn == -INFINITY ? 1.f : exp2f(m[r] - mn);
        m[r] = mn;
        l[r] *= corr[r];
    }
    nb[0] = m[0] == -INFINITY ? 0.f : -m[0];
    nb[1] = m[1] == -INFINITY ? 0.f : -m[1];
}

// The online softmax of one S tile held in the wgmma accumulator layout (row g: elements 0, 1 of
// each n8 chunk; row g + 8: elements 2, 3): scale to base 2, mask the positions after each row's
// own (need_mask: the tile crosses the diagonal for this warp), update the running max m and sum
// l, return the rescale factors of O in corr and P rounded to bf16 in the A-operand layout of
// the P.V wgmma (which is the accumulator layout of S, two n8 chunks per k16 step).
template <bool MASK>
static __device__ __forceinline__ void pd_fa_softmax(float *sc, float *m, float *l, float *corr, uint32_t (*pa)[4],
                                                     int kv0, const int *qpos, int t, float scale_log2) {
    float nb[2];
    pd_fa_row_max<MASK>(sc, m, l, corr, nb, kv0, qpos, t, scale_log2);
#pragma unroll
    for (int kk = 0; kk < PD_FA_BKV / 16; kk++) {
        float p[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            p[i] = exp2f(fmaf(sc[kk * 8 + i], scale_log2, nb[(i >> 1) & 1]));
            l[(i >> 1) & 1] += p[i];
        }
        pa[kk][0] = pd_k_pack2(p[0], p[1]);  // row g, k 2t, 2t + 1
        pa[kk][1] = pd_k_pack2(p[2], p[3]);  // row g + 8
        pa[kk][2] = pd_k_pack2(p[4], p[5]);  // row g, k 2t + 8, 2t + 9
        pa[kk][3] = pd_k_pack2(p[6], p[7]);  // row g + 8
    }
}

// pd_fa_softmax with P left in sc as f32 (pd_fa_pack rounds it into the A-operand layout later):
// the overlapped consumer (PD_FA_OVL) computes it while the previous tile's P.V still reads pa.
template <bool MASK>
static __device__ __forceinline__ void pd_fa_softmax_p(float *sc, float *m, float *l, float *corr, int kv0,
                                                       const int *qpos, int t, float scale_log2) {
    float nb[2];
    pd_fa_row_max<MASK>(sc, m, l, corr, nb, kv0, qpos, t, scale_log2);
#pragma unroll
    for (int i = 0; i < PD_FA_BKV / 2; i++) {
        float p = exp2f(fmaf(sc[i], scale_log2, nb[(i >> 1) & 1]));
        l[(i >> 1) & 1] += p;
        sc[i] = p;
    }
}
static __device__ __forceinline__ void pd_fa_pack(const float *sc, uint32_t (*pa)[4]) {
#pragma unroll
    for (int kk = 0; kk < PD_FA_BKV / 16; kk++) {
        const float *p = sc + kk * 8;
        pa[kk][0] = pd_k_pack2(p[0], p[1]);
        pa[kk][1] = pd_k_pack2(p[2], p[3]);
        pa[kk][2] = pd_k_pack2(p[4], p[5]);
        pa[kk][3] = pd_k_pack2(p[6], p[7]);
    }
}

template <int HD>
static __device__ __forceinline__ void pd_fa_rescale(float *o, const float *corr) {
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
        o[i * 4 + 0] *= corr[0];
        o[i * 4 + 1] *= corr[0];
        o[i * 4 + 2] *= corr[1];
        o[i * 4 + 3] *= corr[1];
    }
}

// The cache slots of the RPT rows r0 + k * RS (k < RPT) of the K/V tile at kv0 (-1 past kv_end: zero
// fill), one page-table load per row (issued together, before the wait for the stage).
template <int RPT, int RS>
static __device__ __forceinline__ void pd_fa_lookup(int *slot, const int32_t *bt, int kv0, int r0, int kv_end, int bs,
                                                    int bs_shift) {
#pragma unroll
    for (int k = 0; k < RPT; k++) {
        int pos = kv0 + r0 + k * RS;
        int pg = bs_shift >= 0 ? pos >> bs_shift : pos / bs, in = pos - pg * bs;
        slot[k] = pos < kv_end ? __ldg(bt + pg) * bs + in : -1;
    }
}

// LKF (session 15; block_size a power of two with RS <= bs <= 128, so a row's page does not depend on
// r0 < RS and a tile holds 128 / bs pages): lane i loads page i of the tile (pd_fa_page_lane, before the
// wait for the stage), and each row takes its page from that lane by a shuffle while its copies are
// issued (pd_fa_copy_lkf), with no branch and no array of slots. The per-row loads of pd_fa_lookup,
// with their dependent address arithmetic under branches, made ptxas wait for each load in turn: the
// producer was latency-bound there and the consumers waited for its tiles (ncu, session 15).
static __device__ __forceinline__ int pd_fa_page_lane(const int32_t *bt, int kv0, int kv_end, int bs_shift) {
    const int lane = threadIdx.x & 31, pg0 = kv0 >> bs_shift;
    const bool has = lane < (PD_FA_BKV >> bs_shift) && ((pg0 + lane) << bs_shift) < kv_end;
    return has ? __ldg(bt + pg0 + lane) : 0;
}
template <int RPT, int RS, bool DK, bool DV>
static __device__ __forceinline__ void pd_fa_copy_lkf(uint32_t dk, uint32_t dv, const __nv_bfloat16 *kc,
                                                      const __nv_bfloat16 *vc, int mine, int kv0, int r0, int c,
                                                      int kv_end, int bs, int bs_shift, size_t kv_row, size_t kv_col) {
    // A row's source is one 32 x 32 -> 64-bit multiply-add from the thread's base (its kv head and chunk):
    // slot * row bytes (a row of the cache is n_kv * HD * 2 bytes, far below 4 GB) + base.
    const char *kb = (const char *)(kc + kv_col), *vb = (const char *)(vc + kv_col);
    const uint32_t row_b = (uint32_t)(kv_row * sizeof(__nv_bfloat16));
    // (8 rows at a time: unrolled whole, ptxas hoists every shuffle and address and spills at 56 registers)
#pragma unroll 8
    for (int k = 0; k < RPT; k++) {
        const int pg = __shfl_sync(0xffffffffu, mine, (k * RS) >> bs_shift);
        const bool ok = kv0 + r0 + k * RS < kv_end;
        const uint32_t slot = ok ? (uint32_t)((pg << bs_shift) + ((k * RS) & (bs - 1)) + r0) : 0u;
        const uint32_t o = pd_fa_swz(r0 + k * RS, c);
        if (DK) pd_fa_cp16(dk + o, kb + (uint64_t)slot * row_b, ok);
        if (DV) pd_fa_cp16(dv + o, vb + (uint64_t)slot * row_b, ok);
    }
}

// ---- the kernel --------------------------------------------------------------------------------

template <int HD, int FL>
static __global__ void __launch_bounds__(PD_FA_THREADS, 1)
    k_attn_prefill_fa3(const __nv_bfloat16 *q, const __nv_bfloat16 *kc, const __nv_bfloat16 *vc, __nv_bfloat16 *out,
                       const int32_t *q_indptr, const int32_t *kv_lens, const int32_t *bt_indptr,
                       const int32_t *bt_indices, int n_q_tiles, int n_seqs, int H, int n_kv, int bs, int bs_shift,
                       int q_stride, float scale_log2, const __grid_constant__ CUtensorMap tmk,
                       const __grid_constant__ CUtensorMap tmv, const __grid_constant__ CUtensorMap tmk_t,
                       const __grid_constant__ CUtensorMap tmv_t) {
    using C = pd_fa_cfg<HD>;
    constexpr int ST = C::ST, CPR = HD / 8;
    constexpr bool VN64 = FL & PD_FA_VN64, PP = FL & PD_FA_PP, ROWP = FL & PD_FA_ROWP;
    constexpr bool NOLOAD = FL & PD_FA_NOLOAD, NOMATH = FL & PD_FA_NOMATH, TMA = FL & PD_FA_TMA, OVL = FL & PD_FA_OVL;
    constexpr bool NOSYNC = FL & PD_FA_NOSYNC, RSC = (FL & PD_FA_RSC) && OVL, MB = FL & PD_FA_MB;
    constexpr bool RSE = (FL & PD_FA_RSE) && OVL;
    constexpr bool DSC = (FL & PD_FA_DSC) && OVL;
    constexpr int REG_P = PD_FA_REG_P, REG_C = PD_FA_REG_C;
    // TMAH (PD_CUDA_FA3_TMA=2): a K/V tile whose 128 positions fill consecutive whole pages comes by
    // TMA (one 128-row box per 64-column block of K and of V: 4 boxes at head_dim 128), any other
    // tile by the default producer's cp.async (no per-page boxes, which made TMA slower on scattered
    // pages). Every producer warp decides the same way from the tile's page-table entries.
    constexpr bool TMAH = (FL & PD_FA_TMAH) && !TMA && !NOLOAD;
    // ARV (the default producer only): each thread's copies of a tile arrive on its "full" barrier
    // through cp.async.mbarrier.arrive.noinc when they land, instead of the thread waiting for tile
    // j - 1's copies after issuing tile j's (a tile is then ready as soon as its bytes are, not one
    // issue later); the consumers fence the async proxy after each wait instead of the producer.
    constexpr bool ARV = (FL & PD_FA_ARV) && !TMA && !TMAH && !ROWP && !NOLOAD;
    // KVS (with OVL and the default producer only): K and V of a stage have their own full and empty
    // barriers. The overlapped consumer is done with K of tile j after its S (mid-turn j) but with V
    // only after P.V (turn j + 1): the producer refills K a turn earlier, and a consumer's S of tile
    // j waits for K alone. The producer issues K_j, arrives on V_{j-1} (landed), issues V_j, arrives
    // on K_j, so full V_{j-1} is always complete when full K_j is.
    constexpr bool KVS = (FL & PD_FA_KVS) && OVL && !TMA && !TMAH && !ROWP && !NOLOAD && !ARV;
    // PERS (persistent, session 15): one block per SM walks the work items (query tile, sequence, head)
    // in the longest-first order, snaking (round r takes items r * G + b, or r * G + G - 1 - b on odd
    // rounds, G blocks), so the rounds' lengths even out. The K/V ring runs on across items (tile count
    // gt); Q has one buffer with an "empty" barrier the consumers arrive on after their last S of an
    // item, and the producer issues the next item's first K/V tile before it waits for that, so the
    // next item's loads overlap the current one's last P.V and output stores (no cold block start).
    // The default producer (cp.async, one tile behind) and the overlapped consumer only.
    constexpr bool PERS = (FL & PD_FA_PERS) && OVL && !TMA && !TMAH && !ROWP && !NOLOAD && !NOMATH && !NOSYNC &&
                          !(FL & PD_FA_KVS);
    extern __shared__ unsigned char pd_fa_smem[];
    const uint32_t base = (pd_k_smem_u32(pd_fa_smem) + 1023u) & ~1023u;
    const uint32_t sq = base, sk = base + C::TILE, sv = sk + ST * C::TILE, bar = sv + ST * C::TILE;
    // bar + 8 * i: full[i]; bar + 8 * (ST + i): empty[i]; bar + 16 * ST: the Q tile; KVS: those two
    // are K's, and bar + 8 * (2 * ST + 1 + i): V's full[i], bar + 8 * (3 * ST + 1 + i): V's empty[i].
    const uint32_t barv = bar + 8 * (2 * ST + 1), qfull = bar + 16 * ST, qempty = bar + 8 * (4 * ST + 1);

    const int per_tile = n_seqs * H, n_items = n_q_tiles * per_tile;
    int q_begin, q_len, kv_len, row0, row_end, pos0, kv_end, n_tiles, kvh, h;
    const int32_t *bt;
    // Work item it: (query tile, sequence, head); false when it has no rows (nothing to do).
    auto item = [&](int it) {
        int qt = n_q_tiles - 1 - it / per_tile;  // longest tiles first
        int s = (it % per_tile) / H;
        h = it % H;
        q_begin = q_indptr[s], q_len = q_indptr[s + 1] - q_begin;
        if (q_len <= 1 || qt * PD_FA_BQ >= q_len) return false;  // q_len == 1: the decode kernel's
        kv_len = kv_lens[s];
        row0 = qt * PD_FA_BQ, row_end = min(q_len, row0 + PD_FA_BQ);
        pos0 = kv_len - q_len + row0;       // position of tile row 0
        kv_end = kv_len - q_len + row_end;  // exclusive bound over the tile's rows
        n_tiles = (kv_end + PD_FA_BKV - 1) / PD_FA_BKV;
        kvh = h / (H / n_kv);
        bt = bt_indices + bt_indptr[s];
        return true;
    };
    const int NB = PERS ? (int)gridDim.x : 1, n_rounds = PERS ? (n_items + NB - 1) / NB : 1;
    auto item_of = [&](int r) { return (r & 1) ? r * NB + NB - 1 - (int)blockIdx.x : r * NB + (int)blockIdx.x; };
    if (!PERS && !item(blockIdx.x)) return;

    if (threadIdx.x == 0) {
        for (int i = 0; i < ST; i++) {
            pd_fa_mbar_init(bar + 8 * i, 128);
            pd_fa_mbar_init(bar + 8 * (ST + i), 256);
        }
        pd_fa_mbar_init(qfull, 128);
        pd_fa_mbar_init(qempty, 256);
        for (int i = 0; i < ST && KVS; i++) {
            pd_fa_mbar_init(barv + 8 * i, 128);
            pd_fa_mbar_init(barv + 8 * (ST + i), 256);
        }
    }
    __syncthreads();
    // The warpgroup index through a shuffle: the compiler then knows it is warp-uniform
    int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0), tw = threadIdx.x & 127;

    if (wg == 0) {
        // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_P));
        // LKF: the lane-parallel lookups (their conditions; 128 / CPR rows a pass)
        const bool lkf = (FL & PD_FA_LKF) && bs_shift >= 0 && bs >= 128 / CPR && bs <= PD_FA_BKV;
        if constexpr (PERS) {
            // Per item: K/V tile 0, then (after the consumers' "Q empty" of the previous item) Q, then
            // tiles 1 ..; arrivals one commit group behind as below (tile 0 and Q together with tile 1's issue).
            constexpr int RS = 128 / CPR, RPT = PD_FA_BKV / RS;
            const int r0 = tw / CPR, c = tw % CPR;
            const size_t kv_row = (size_t)n_kv * HD;
            int gp = 0, n = 0;
            for (int r = 0; r < n_rounds; r++) {
                const int it = item_of(r);
                if (it >= n_items || !item(it)) continue;
                const size_t kv_col = (size_t)kvh * HD + c * 8;
                for (int j = 0; j < n_tiles; j++) {
                    const int g = gp + j, st = g % ST, kv0 = j * PD_FA_BKV;
                    const uint32_t dk = sk + st * C::TILE, dv = sv + st * C::TILE;
                    int slot[RPT], mine = 0;
                    if (lkf) mine = pd_fa_page_lane(bt, kv0, kv_end, bs_shift);
                    else pd_fa_lookup<RPT, RS>(slot, bt, kv0, r0, kv_end, bs, bs_shift);
                    if (g >= ST) pd_fa_mbar_wait(bar + 8 * (ST + st), ((g / ST) - 1) & 1);
                    if (lkf) {
                        pd_fa_copy_lkf<RPT, RS, true, true>(dk, dv, kc, vc, mine, kv0, r0, c, kv_end, bs, bs_shift, kv_row, kv_col);
                    } else {
#pragma unroll
                        for (int k = 0; k < RPT; k++) {
                            bool ok = slot[k] >= 0;
                            size_t off = ok ? (size_t)slot[k] * kv_row + kv_col : 0;
                            uint32_t o = pd_fa_swz(r0 + k * RS, c);
                            pd_fa_cp16(dk + o, kc + off, ok);
                            pd_fa_cp16(dv + o, vc + off, ok);
                        }
                    }
                    pd_k_cp_async_commit();
                    if constexpr (ARV) pd_fa_cp_arrive(bar + 8 * st);  // (ARV: each group arrives as it lands)
                    if (j == 0) {
                        if (n > 0) pd_fa_mbar_wait(qempty, (n - 1) & 1);  // the previous item's every S is done
                        for (int i = tw; i < PD_FA_BQ * CPR; i += 128) {
                            int qr = i / CPR, qc = i % CPR;
                            bool ok = row0 + qr < q_len;
                            const __nv_bfloat16 *src =
                                q + (size_t)(q_begin + (ok ? row0 + qr : 0)) * q_stride + (size_t)h * HD + qc * 8;
                            pd_fa_cp16(sq + pd_fa_swz(qr, qc), src, ok);
                        }
                        pd_k_cp_async_commit();
                        if constexpr (ARV) pd_fa_cp_arrive(qfull);
                        continue;
                    }
                    if constexpr (ARV) continue;
                    pd_k_cp_async_wait<1>();  // all but tile g: j == 1: tile g - 1 and Q, else tile g - 1
                    pd_fa_fence_async();
                    pd_fa_mbar_arrive(bar + 8 * ((g - 1) % ST));
                    if (j == 1) pd_fa_mbar_arrive(qfull);
                }
                if constexpr (!ARV) {
                    pd_k_cp_async_wait<0>();
                    pd_fa_fence_async();
                    pd_fa_mbar_arrive(bar + 8 * ((gp + n_tiles - 1) % ST));
                    if (n_tiles == 1) pd_fa_mbar_arrive(qfull);
                }
                gp += n_tiles, n++;
            }
            if constexpr (ARV) pd_k_cp_async_wait<0>();
        } else {  // one item (the block's)
        for (int i = tw; i < PD_FA_BQ * CPR; i += 128) {
            int r = i / CPR, c = i % CPR;
            bool ok = row0 + r < q_len;
            const __nv_bfloat16 *src = q + (size_t)(q_begin + (ok ? row0 + r : 0)) * q_stride + (size_t)h * HD + c * 8;
            pd_fa_cp16(sq + pd_fa_swz(r, c), src, ok);
        }
        pd_k_cp_async_commit();
        if constexpr (ARV) pd_fa_cp_arrive(bar + 16 * ST);
        // Thread tw copies 16-byte chunk c = tw % CPR of rows tw / CPR + k * RS (k < RPT) of each
        // tile. The page-table lookups of a tile are issued together (independent loads) before
        // the wait for its stage, then the copies; ROWP: the first version, lookup and copies row
        // after row (each copy waits for its lookup).
        constexpr int RS = 128 / CPR, RPT = PD_FA_BKV / RS, CB = HD / 64;
        const int r0 = tw / CPR, c = tw % CPR;
        const size_t kv_row = (size_t)n_kv * HD, kv_col = (size_t)kvh * HD + c * 8;
        if constexpr (KVS) {
            for (int j = 0; j < n_tiles; j++) {
                int st = j % ST, kv0 = j * PD_FA_BKV, ph = ((j / ST) - 1) & 1;
                uint32_t dk = sk + st * C::TILE, dv = sv + st * C::TILE;
                int slot[RPT], mine = 0;
                if (lkf) mine = pd_fa_page_lane(bt, kv0, kv_end, bs_shift);
                else pd_fa_lookup<RPT, RS>(slot, bt, kv0, r0, kv_end, bs, bs_shift);
                if (j >= ST && !NOSYNC) pd_fa_mbar_wait(bar + 8 * (ST + st), ph);
                if (lkf) {
                    pd_fa_copy_lkf<RPT, RS, true, false>(dk, dv, kc, vc, mine, kv0, r0, c, kv_end, bs, bs_shift, kv_row, kv_col);
                } else {
#pragma unroll
                    for (int k = 0; k < RPT; k++)
                        pd_fa_cp16(dk + pd_fa_swz(r0 + k * RS, c),
                                   kc + (slot[k] >= 0 ? (size_t)slot[k] * kv_row + kv_col : 0), slot[k] >= 0);
                }
                pd_k_cp_async_commit();
                pd_k_cp_async_wait<1>();  // all but K_j: the Q tile (j == 0) or V_{j-1}
                pd_fa_fence_async();
                pd_fa_mbar_arrive(j == 0 ? bar + 16 * ST : barv + 8 * ((j - 1) % ST));
                if (j >= ST && !NOSYNC) pd_fa_mbar_wait(barv + 8 * (ST + st), ph);
                if (lkf) {
                    pd_fa_copy_lkf<RPT, RS, false, true>(dk, dv, kc, vc, mine, kv0, r0, c, kv_end, bs, bs_shift, kv_row, kv_col);
                } else {
#pragma unroll
                    for (int k = 0; k < RPT; k++)
                        pd_fa_cp16(dv + pd_fa_swz(r0 + k * RS, c),
                                   vc + (slot[k] >= 0 ? (size_t)slot[k] * kv_row + kv_col : 0), slot[k] >= 0);
                }
                pd_k_cp_async_commit();
                pd_k_cp_async_wait<1>();  // all but V_j: K_j
                pd_fa_fence_async();
                pd_fa_mbar_arrive(bar + 8 * st);
            }
            pd_k_cp_async_wait<0>();
            pd_fa_fence_async();
            pd_fa_mbar_arrive(barv + 8 * ((n_tiles - 1) % ST));
        } else {
            for (int j = 0; j < n_tiles; j++) {
                int st = j % ST, kv0 = j * PD_FA_BKV;
                uint32_t dk = sk + st * C::TILE, dv = sv + st * C::TILE;
                if constexpr (TMA || TMAH) {
                    // Pages wholly inside the cache rows of this sequence (< kv_len) come by TMA, one box
                    // per (page, 64-element column block) for K and V, issued by the first CB * pages
                    // threads; the rest (the page holding kv_len, if partial, and pages past it) by
                    // cp.async with zeros past kv_end, so the masked rows hold no stale NaN.
                    int pg0 = kv0 / bs, n_full = min(max(kv_len / bs - pg0, 0), PD_FA_BKV / bs);
                    int cp_from = kv0 + n_full * bs;
                    int pg = tw / CB, cb = tw % CB;
                    int page = tw < n_full * CB ? __ldg(bt + pg0 + pg) : 0;
                    // A whole tile in consecutive pages (a fresh prompt's pages often are) comes as one
                    // box of 128 rows per column block (tmk_t / tmv_t) instead of one per page.
                    bool run = false;
                    if constexpr (TMAH) {  // every warp: lane l holds the page of box l (n_full * CB <= 32)
                        int lane = tw & 31, lp = lane < n_full * CB ? __ldg(bt + pg0 + lane / CB) : 0;
                        int first = __shfl_sync(0xffffffffu, lp, 0);
                        run = __all_sync(0xffffffffu, n_full * bs == PD_FA_BKV &&
                                                          (lane >= n_full * CB || lp == first + lane / CB));
                        if (!run) cp_from = kv0;  // the whole tile by cp.async
                    } else if (tw < 32) {
                        int first = __shfl_sync(0xffffffffu, page, 0);
                        run = __all_sync(0xffffffffu, n_full * bs == PD_FA_BKV &&
                                                          (tw >= n_full * CB || page == first + pg));
                    }
                    int slot[RPT];
#pragma unroll
                    for (int k = 0; k < RPT; k++) {
                        int pos = kv0 + r0 + k * RS;
                        int pgk = bs_shift >= 0 ? pos >> bs_shift : pos / bs, in = pos - pgk * bs;
                        slot[k] = pos >= cp_from && pos < kv_end ? __ldg(bt + pgk) * bs + in : -1;
                    }
                    if (j >= ST && !NOSYNC) pd_fa_mbar_wait(bar + 8 * (ST + st), ((j / ST) - 1) & 1);
                    if (tw == 0 && n_full > 0 && (!TMAH || run))
                        pd_fa_mbar_expect_tx(bar + 8 * st, (uint32_t)(n_full * bs * HD * 2 * 2));
                    __syncwarp();
                    if (run) {
                        if (tw < CB) {
                            uint32_t o = (uint32_t)(cb * (PD_FA_BKV * 128));
                            pd_fa_tma3(dk + o, &tmk_t, cb * 64, kvh, page * bs, bar + 8 * st);
                            pd_fa_tma3(dv + o, &tmv_t, cb * 64, kvh, page * bs, bar + 8 * st);
                        }
                    } else if (!TMAH && tw < n_full * CB) {
                        uint32_t o = (uint32_t)(cb * (PD_FA_BKV * 128) + pg * bs * 128);
                        pd_fa_tma3(dk + o, &tmk, cb * 64, kvh, page * bs, bar + 8 * st);
                        pd_fa_tma3(dv + o, &tmv, cb * 64, kvh, page * bs, bar + 8 * st);
                    }
#pragma unroll
                    for (int k = 0; k < RPT; k++) {
                        if (kv0 + r0 + k * RS < cp_from) continue;
                        bool ok = slot[k] >= 0;
                        size_t off = ok ? (size_t)slot[k] * kv_row + kv_col : 0;
                        uint32_t o = pd_fa_swz(r0 + k * RS, c);
                        pd_fa_cp16(dk + o, kc + off, ok);
                        pd_fa_cp16(dv + o, vc + off, ok);
                    }
                } else if constexpr (ROWP) {
                    if (j >= ST && !NOSYNC) pd_fa_mbar_wait(bar + 8 * (ST + st), ((j / ST) - 1) & 1);
                    for (int i = tw; i < PD_FA_BKV * CPR; i += 128) {
                        int r = i / CPR, cc = i % CPR, pos = kv0 + r;
                        bool ok = pos < kv_end;
                        size_t off = 0;
                        if (ok) off = ((size_t)(bt[pos / bs] * bs + pos % bs) * n_kv + kvh) * HD + cc * 8;
                        uint32_t o = pd_fa_swz(r, cc);
                        pd_fa_cp16(dk + o, kc + off, ok);
                        pd_fa_cp16(dv + o, vc + off, ok);
                    }
                } else {
                    int slot[RPT], mine = 0;
                    if (lkf) mine = pd_fa_page_lane(bt, kv0, kv_end, bs_shift);
                    else pd_fa_lookup<RPT, RS>(slot, bt, kv0, r0, kv_end, bs, bs_shift);
                    if (j >= ST && !NOSYNC) pd_fa_mbar_wait(bar + 8 * (ST + st), ((j / ST) - 1) & 1);
                    // NOLOAD (diag): the ring's first ST tiles are copied (real data in every stage: the
                    // tensor cores' power, and so the clock, depend on it), later tiles only pass the barriers
                    if (lkf) {
                        if (!NOLOAD || j < ST)
                            pd_fa_copy_lkf<RPT, RS, true, true>(dk, dv, kc, vc, mine, kv0, r0, c, kv_end, bs, bs_shift,
                                                                kv_row, kv_col);
                    } else {
#pragma unroll
                        for (int k = 0; k < RPT && (!NOLOAD || j < ST); k++) {
                            bool ok = slot[k] >= 0;
                            size_t off = ok ? (size_t)slot[k] * kv_row + kv_col : 0;
                            uint32_t o = pd_fa_swz(r0 + k * RS, c);
                            pd_fa_cp16(dk + o, kc + off, ok);
                            pd_fa_cp16(dv + o, vc + off, ok);
                        }
                    }
                }
                pd_k_cp_async_commit();
                if constexpr (ARV) {
                    pd_fa_cp_arrive(bar + 8 * st);
                    continue;
                }
                pd_k_cp_async_wait<1>();  // everything but tile j: the Q tile (j == 0) or tile j - 1
                pd_fa_fence_async();
                pd_fa_mbar_arrive(j == 0 ? bar + 16 * ST : bar + 8 * ((j - 1) % ST));
            }
            pd_k_cp_async_wait<0>();
            if constexpr (ARV) return;  // every tile has arrived (or will, as its copies land)
            pd_fa_fence_async();
            pd_fa_mbar_arrive(bar + 8 * ((n_tiles - 1) % ST));
        }
        }  // PERS
        return;
    }

    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_C));
    const int cw = wg - 1, warp = tw >> 5, lane = tw & 31, g = lane >> 2, t = lane & 3;
    const int wr = cw * 64 + warp * 16;  // the warp's first row in the tile
    // gt: K/V tiles of the earlier items (PERS: the ring runs on across items; 0 otherwise)
    int gt_run = 0, n_it = 0;
    for (int rr = 0; rr < n_rounds; rr++) {
    if constexpr (PERS) {
        const int it = item_of(rr);
        if (it >= n_items || !item(it)) continue;
    }
    const int gt = PERS ? gt_run : 0;
    int qpos[2] = {pos0 + wr + g, pos0 + wr + g + 8};
    bool live = row0 + cw * 64 < q_len;
    int last_pos = pos0 + min(cw * 64 + 63, row_end - row0 - 1);  // the warpgroup's last row
    // Tiles [0, n_mine) hold positions at or before this warpgroup's last row; the rest are
    // waited for and released untouched (the other warpgroup may need them).
    int n_mine = live ? last_pos / PD_FA_BKV + 1 : 0;
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, corr[2];
    const uint32_t qa = sq + cw * 64 * 128;  // this warpgroup's 64 rows of Q
    uint32_t pa[PD_FA_BKV / 16][4];

    pd_fa_mbar_wait(qfull, PERS ? n_it & 1 : 0);
    if constexpr (ARV) pd_fa_fence_async();
    // PP (ping-pong): the two consumers take turns issuing their products (named barriers 1 and
    // 2, 256 threads: one warpgroup syncs, the other arrives), so one's softmax overlaps the
    // other's tensor-core work. Both run the handshake on every tile, computing or not, and the
    // second skips its last arrive, so the counts match.
    if (PP && cw == 1) pd_fa_bar_arrive(1);
    // OVL (intra-warpgroup overlap, FA3's second pipelining): turn j issues S of tile j and then
    // P.V of tile j - 1 as two commit groups, waits for S alone, runs the softmax of tile j while
    // that P.V runs, then waits for it, releases tile j - 1's stage and rounds tile j's P into pa.
    // Without RSE, O is rescaled by tile j - 1's factors before the turn's wgmma.fence (no accumulator of a
    // wgmma in flight is touched by other instructions). Registers: O, S (f32) and one P (bf16).
    // The loops are split so that no wgmma, fence, commit or wait sits under a condition:
    // tile 0 (S and softmax), tiles 1 .. n_comp - 1 (the overlapped turns), the last P.V, then the
    // tiles this warpgroup only passes through (its rows end before them; the other may need them).
    // With PP the second warpgroup arrives on every tile, the first consumes the extra arrival at
    // the end (the handshake has no conditional arrive).
    if constexpr (OVL) {
        float sc[PD_FA_BKV / 2];
        const int n_comp = NOMATH ? 0 : n_mine;
        if (n_comp > 0) {
            if (!NOSYNC) pd_fa_mbar_wait(bar + 8 * (gt % ST), (gt / ST) & 1);
            if constexpr (ARV) pd_fa_fence_async();
            if (PP) pd_fa_bar_sync(1 + cw);
            pd_fa_pin<PD_FA_BKV / 2>(sc);
            pd_fa_wg_fence();
            if constexpr (DSC) pd_fa_issue_s<HD, true>(sc, pd_fa_dlo(qa, 16), pd_fa_dlo(sk + (gt % ST) * C::TILE, 16));
            else pd_fa_issue_s<HD>(sc, qa, sk + (gt % ST) * C::TILE);
            pd_fa_wg_commit();
            if (PP) pd_fa_bar_arrive(2 - cw);
            pd_fa_wg_wait<0>();
            pd_fa_pin<PD_FA_BKV / 2>(sc);
            if constexpr (KVS) pd_fa_mbar_arrive(bar + 8 * (ST + gt % ST));  // K of tile 0
            if (!MB || pos0 + wr < PD_FA_BKV - 1) pd_fa_softmax_p<true>(sc, m, l, corr, 0, qpos, t, scale_log2);
            else pd_fa_softmax_p<false>(sc, m, l, corr, 0, qpos, t, scale_log2);
            pd_fa_pack(sc, pa);
            for (int j = 1; j < n_comp; j++) {
                const int st = (gt + j) % ST, sp = (gt + j - 1) % ST, kv0 = j * PD_FA_BKV;
                // DSC: the descriptors' low words now, pinned, so that the handshake's turn holds only the wgmmas
                uint32_t ql = pd_fa_dlo(qa, 16), kl = pd_fa_dlo(sk + st * C::TILE, 16);
                uint32_t vl = pd_fa_dlo(sv + sp * C::TILE, PD_FA_BKV * 128);
                if constexpr (DSC) asm volatile("" : "+r"(ql), "+r"(kl), "+r"(vl)::"memory");
                if (!NOSYNC) pd_fa_mbar_wait(bar + 8 * st, ((gt + j) / ST) & 1);
                if constexpr (ARV) pd_fa_fence_async();
                if (PP) pd_fa_bar_sync(1 + cw);
                if (KVS && !NOSYNC) pd_fa_mbar_wait(barv + 8 * sp, ((gt + j - 1) / ST) & 1);  // complete already
                if (!RSE && (!RSC || __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))) pd_fa_rescale<HD>(o, corr);
                pd_fa_pin<HD / 2>(o);
                pd_fa_pin<PD_FA_BKV / 2>(sc);
                pd_fa_pin_u<PD_FA_BKV / 16>(pa);
                pd_fa_wg_fence();
                if constexpr (DSC) pd_fa_issue_s<HD, true>(sc, ql, kl);
                else pd_fa_issue_s<HD>(sc, qa, sk + st * C::TILE);
                pd_fa_wg_commit();
                if constexpr (DSC) pd_fa_issue_pv<HD, VN64, true>(o, pa, vl);
                else pd_fa_issue_pv<HD, VN64>(o, pa, sv + sp * C::TILE);
                pd_fa_wg_commit();
                if (PP) pd_fa_bar_arrive(2 - cw);
                pd_fa_wg_wait<1>();
                pd_fa_pin<PD_FA_BKV / 2>(sc);
                if constexpr (KVS) pd_fa_mbar_arrive(bar + 8 * (ST + st));  // K of tile j
                if (!MB || kv0 + PD_FA_BKV - 1 > pos0 + wr) pd_fa_softmax_p<true>(sc, m, l, corr, kv0, qpos, t, scale_log2);
                else pd_fa_softmax_p<false>(sc, m, l, corr, kv0, qpos, t, scale_log2);
                pd_fa_wg_wait<0>();
                pd_fa_pin<HD / 2>(o);
                pd_fa_pin_u<PD_FA_BKV / 16>(pa);  // P.V read pa until here: the pack must not reuse them
                pd_fa_mbar_arrive(KVS ? barv + 8 * (ST + sp) : bar + 8 * (ST + sp));
                // RSE: O (P.V of tile j - 1 done) moves to tile j's max here, before the next turn's handshake
                if (RSE && (!RSC || __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))) pd_fa_rescale<HD>(o, corr);
                pd_fa_pack(sc, pa);
            }
            if constexpr (PERS) pd_fa_mbar_arrive(qempty);  // every S of this warpgroup is done: Q is free
            const int sl = (gt + n_comp - 1) % ST;
            if (KVS && !NOSYNC) pd_fa_mbar_wait(barv + 8 * sl, ((gt + n_comp - 1) / ST) & 1);
            // (RSE: done in the last turn; with n_comp == 1, O is still zero)
            if (!RSE && (!RSC || __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))) pd_fa_rescale<HD>(o, corr);
            pd_fa_pin<HD / 2>(o);
            pd_fa_pin_u<PD_FA_BKV / 16>(pa);
            pd_fa_wg_fence();
            if constexpr (DSC) pd_fa_issue_pv<HD, VN64, true>(o, pa, pd_fa_dlo(sv + sl * C::TILE, PD_FA_BKV * 128));
            else pd_fa_issue_pv<HD, VN64>(o, pa, sv + sl * C::TILE);
            pd_fa_wg_commit();
            pd_fa_wg_wait<0>();
            pd_fa_pin<HD / 2>(o);
            pd_fa_mbar_arrive(KVS ? barv + 8 * (ST + sl) : bar + 8 * (ST + sl));
        } else if (PERS) {
            pd_fa_mbar_arrive(qempty);
        }
        for (int j = n_comp; j < n_tiles; j++) {
            const int st = (gt + j) % ST;
            if (!NOSYNC) pd_fa_mbar_wait(bar + 8 * st, ((gt + j) / ST) & 1);
            if (PP) pd_fa_bar_sync(1 + cw);
            if (PP) pd_fa_bar_arrive(2 - cw);
            pd_fa_mbar_arrive(bar + 8 * (ST + st));
            if constexpr (KVS) {
                if (!NOSYNC) pd_fa_mbar_wait(barv + 8 * st, ((gt + j) / ST) & 1);
                pd_fa_mbar_arrive(barv + 8 * (ST + st));
            }
        }
        if (PP && cw == 0) pd_fa_bar_sync(1);  // the second warpgroup's last arrival
        // PERS: the second warpgroup's first arrival of the next item must not meet its last of this one
        if (PERS && PP) pd_fa_bar_sync(3);
    }
    for (int j = 0; j < n_tiles && !OVL; j++) {
        int st = (gt + j) % ST, kv0 = j * PD_FA_BKV;
        bool pass = PP && !(cw == 1 && j == n_tiles - 1);
        if (!NOSYNC) pd_fa_mbar_wait(bar + 8 * st, ((gt + j) / ST) & 1);
        if constexpr (ARV) pd_fa_fence_async();
        if (PP) pd_fa_bar_sync(1 + cw);
        if (NOMATH || j >= n_mine) {  // warpgroup-uniform
            if (pass) pd_fa_bar_arrive(2 - cw);
            pd_fa_mbar_arrive(bar + 8 * (ST + st));
            continue;
        }
        const uint32_t kt = sk + st * C::TILE;
        bool need_mask = kv0 + PD_FA_BKV - 1 > pos0 + wr;
        float sc[PD_FA_BKV / 2];
        {
            pd_fa_pin<PD_FA_BKV / 2>(sc);
            pd_fa_wg_fence();
            pd_fa_issue_s<HD>(sc, qa, kt);
            pd_fa_wg_commit();
            if (pass) pd_fa_bar_arrive(2 - cw);
            pd_fa_wg_wait<0>();
            pd_fa_pin<PD_FA_BKV / 2>(sc);
            if (!MB || need_mask) pd_fa_softmax<true>(sc, m, l, corr, pa, kv0, qpos, t, scale_log2);
            else pd_fa_softmax<false>(sc, m, l, corr, pa, kv0, qpos, t, scale_log2);
            pd_fa_rescale<HD>(o, corr);
            pd_fa_pin<HD / 2>(o);
            pd_fa_wg_fence();
            pd_fa_issue_pv<HD, VN64>(o, pa, sv + st * C::TILE);
            pd_fa_wg_commit();
            pd_fa_wg_wait<0>();
            pd_fa_pin<HD / 2>(o);
            pd_fa_mbar_arrive(bar + 8 * (ST + st));
        }
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
        for (int i = 0; i < HD / 8; i++)
            *(uint32_t *)(dst + i * 8 + 2 * t) = pd_k_pack2(o[i * 4 + 2 * r] * l[r], o[i * 4 + 2 * r + 1] * l[r]);
    }
    gt_run += n_tiles, n_it++;
    }  // items
}

// ---- launch ------------------------------------------------------------------------------------

// PD_CUDA_ATTN_PREFILL=0: always the mma.sync kernel (A/B knob).
static bool pd_fa_enabled() {
    static int on = -1;
    return pd_k_env_on("PD_CUDA_ATTN_PREFILL", &on);
}
// The flag set for head_dim hd. Defaults from the H100 measurements (tools/gpu/NOTES.md, fa3-2, pf12-1):
// ping-pong on at head_dim 128 (400 vs 395 TFLOP/s at 8k), off at 64 (300 vs 317-324); P.V as one wgmma per
// k-step; the overlapped consumer (OVL) on (head_dim 128 at 8k: 426-431 vs 412-413; 64: 303-306 vs 292-293),
// with K and V on separate barriers (KVS) at head_dim 64 only (319-320 vs 303-306 at 8k; at 128: 375-377).
// Session 14 (fa14-3): MB (the causal mask in its own code path, only on tiles crossing the diagonal) and
// RSC on, both exact (hd 128 at 8k: 444-449 vs 430-435; hd 64: 354-359 vs 323-325); the other variants
// are built without them (pd_fa_dispatch drops the two before looking for the combination).
// Session 15 (fa15-1..3): RSE on (O rescaled after the turn's P.V wait; +2% at 8k), and at head_dim 128 ARV
// (copies arrive as they land, not one tile behind) + LKF (lane-parallel page lookups): 8k 485-486 vs
// 440-442 TFLOP/s; ARV without LKF 439-440, LKF without ARV slower (406-410). At head_dim 64 ARV + LKF
// (PD_CUDA_FA3_ARV=1 PD_CUDA_FA3_LKF=1, KVS off) measured 384-385 vs 370-371 at 8k, exact in fa3_probe, but
// not yet run through test_gpu_golden: KVS stays the default there. DSC (descriptor words) level, PERS
// (persistent blocks) slower (468-470): both off, measurement knobs.
// Knobs, read once, "1" on / "0" off (anything else aborts): PD_CUDA_FA3_PP (ping-pong), PD_CUDA_FA3_OVL,
// PD_CUDA_FA3_KVS, PD_CUDA_FA3_VN64 (P.V of head_dim 128 as two n64 wgmmas), PD_CUDA_FA3_ARV,
// PD_CUDA_FA3_ROWP (the first producer), PD_CUDA_FA3_TMA (whole pages by TMA; both without OVL unless it is
// set), PD_CUDA_FA3_RSC (default 1; with OVL: O rescaled only when a row of the warp changed its running
// max; a warp-uniform branch, exact: the factor is exp2(0) = 1 otherwise), PD_CUDA_FA3_MB (default 1: the
// causal mask in its own code path; 0: applied by predication on every tile); with -DPD_FA3_DIAG also
// PD_CUDA_FA3_DIAG=noload|nomath|nosync (noload: the ring's stages are filled once with real data, then
// the producer only passes the barriers; nomath: the consumers only pass the barriers; nosync: nobody waits
// on the ring, copies and math run uncoupled). A combination that is not instantiated (pd_fa_dispatch)
// runs the default kernel, with a warning.
static int pd_fa_env(const char *name) {  // 1, 0, or -1 when unset; anything else is refused (abort)
    return pd_k_env_int(name, -1, 0, 1);
}
static int pd_fa_flags(int hd) {
    static int pp = -2, vn = -2, rowp = -2, tma = -2, ovl = -2, arv = -2, kvs = -2, diag = 0, rsc = -2, mb = -2;
    static int rse = -2, lkf = -2, pers = -2, dsc = -2;
    if (pp == -2) {
        rsc = pd_fa_env("PD_CUDA_FA3_RSC"), mb = pd_fa_env("PD_CUDA_FA3_MB");
        rse = pd_fa_env("PD_CUDA_FA3_RSE"), lkf = pd_fa_env("PD_CUDA_FA3_LKF"), dsc = pd_fa_env("PD_CUDA_FA3_DSC"), pers = pd_fa_env("PD_CUDA_FA3_PERS");
        vn = pd_fa_env("PD_CUDA_FA3_VN64"), rowp = pd_fa_env("PD_CUDA_FA3_ROWP");
        tma = pd_k_env_int("PD_CUDA_FA3_TMA", -1, 0, 2);  // 2: TMAH (head_dim 128; the default kernel at 64)
        ovl = pd_fa_env("PD_CUDA_FA3_OVL"), arv = pd_fa_env("PD_CUDA_FA3_ARV"), kvs = pd_fa_env("PD_CUDA_FA3_KVS");
#ifdef PD_FA3_DIAG
        const char *d = getenv("PD_CUDA_FA3_DIAG");
        diag = d && !strcmp(d, "noload")   ? PD_FA_NOLOAD
               : d && !strcmp(d, "nomath") ? PD_FA_NOMATH
               : d && !strcmp(d, "nosync") ? PD_FA_NOSYNC
                                           : 0;
        if (d && *d && !diag) {
            fprintf(stderr, "PD_CUDA_FA3_DIAG=%s: expected noload, nomath or nosync\n", d);
            abort();
        }
#endif
        pp = pd_fa_env("PD_CUDA_FA3_PP");
    }
    bool other_producer = rowp == 1 || tma == 1;
    bool use_ovl = ovl < 0 ? !other_producer : ovl == 1;
    bool use_arv = (arv < 0 ? hd == 128 : arv == 1) && !other_producer && tma != 2;
    bool use_pers = pers == 1 && use_ovl && !other_producer && tma != 2 && !diag;
    bool use_kvs = use_ovl && !use_arv && !other_producer && !diag && !use_pers && (kvs < 0 ? hd == 64 : kvs == 1);
    return (rsc != 0 && use_ovl ? PD_FA_RSC : 0) | (mb != 0 ? PD_FA_MB : 0) | ((pp < 0 ? hd == 128 : pp) ? PD_FA_PP : 0) | (vn == 1 && hd == 128 ? PD_FA_VN64 : 0) |
           (rowp == 1 ? PD_FA_ROWP : 0) | (tma == 1 ? PD_FA_TMA : 0) | (tma == 2 && hd == 128 ? PD_FA_TMAH : 0) |
           (use_ovl ? PD_FA_OVL : 0) |
           (use_arv ? PD_FA_ARV : 0) | (use_kvs ? PD_FA_KVS : 0) | (rse != 0 && use_ovl ? PD_FA_RSE : 0) |
           ((lkf < 0 ? hd == 128 : lkf == 1) && !other_producer && tma != 2 ? PD_FA_LKF : 0) | (dsc == 1 && use_ovl ? PD_FA_DSC : 0) | (use_pers ? PD_FA_PERS : 0) | diag;
}

template <int HD, int FL>
static void pd_fa_launch(const pd_attention_kparams *p, cudaStream_t s, const CUtensorMap *tm) {
    static bool attr_set = false;  // per instantiation; the first launch raises the smem limit
    if (!attr_set) {
        cudaFuncSetAttribute(k_attn_prefill_fa3<HD, FL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             pd_fa_cfg<HD>::SMEM);
        attr_set = true;
    }
    int n_q_tiles = (p->max_q_len + PD_FA_BQ - 1) / PD_FA_BQ;
    dim3 grid((unsigned)(n_q_tiles * p->n_seqs * p->n_heads));
    if (FL & PD_FA_PERS) {  // one block per SM (the device's SM count, read once per instantiation)
        static int n_sm = 0;
        if (!n_sm) {
            int dev = 0;
            cudaGetDevice(&dev);
            if (cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n_sm < 1) n_sm = 132;
        }
        if ((int)grid.x > n_sm) grid.x = (unsigned)n_sm;
    }
    int bs_shift = -1;  // log2(block_size) when it is a power of two (shifts instead of divisions)
    for (int i = 0; i < 31; i++)
        if (p->block_size == 1 << i) bs_shift = i;
    k_attn_prefill_fa3<HD, FL><<<grid, PD_FA_THREADS, pd_fa_cfg<HD>::SMEM, s>>>(
        (const __nv_bfloat16 *)p->q, (const __nv_bfloat16 *)p->k_cache, (const __nv_bfloat16 *)p->v_cache,
        (__nv_bfloat16 *)p->out, p->q_indptr, p->kv_lens, p->bt_indptr, p->bt_indices, n_q_tiles, p->n_seqs,
        p->n_heads, p->n_kv_heads, p->block_size, bs_shift, p->q_stride, p->scale * PD_FA_LOG2E, tm[0], tm[1], tm[2],
        tm[3]);
}

// Tensor maps of the K and V caches for the TMA producer: (head_dim, n_kv, slots) bf16, boxes of 64 x 1 x
// block_size with the 128-byte swizzle. The slot extent is a bound the page ids never reach (the
// kernel only asks for pages of the table). False when the driver lacks the encoder or rejects the map.
static bool pd_fa_tensor_maps(const pd_attention_kparams *p, CUtensorMap tm[4]) {
    static PFN_cuTensorMapEncodeTiled_v12000 enc = NULL;
    static int tried = 0;
    if (!tried) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            enc = (PFN_cuTensorMapEncodeTiled_v12000)fn;
        tried = 1;
    }
    if (!enc) return false;
    cuuint64_t dims[3] = {(cuuint64_t)p->head_dim, (cuuint64_t)p->n_kv_heads, (cuuint64_t)1 << 28};
    cuuint64_t strides[2] = {(cuuint64_t)p->head_dim * 2, (cuuint64_t)p->n_kv_heads * p->head_dim * 2};
    cuuint32_t box[3] = {64, 1, (cuuint32_t)p->block_size}, box_t[3] = {64, 1, PD_FA_BKV}, estr[3] = {1, 1, 1};
    const void *ptr[2] = {p->k_cache, p->v_cache};
    for (int i = 0; i < 4; i++)  // tm[0], tm[1]: one page of K, V; tm[2], tm[3]: a whole tile of consecutive pages
        if (enc(&tm[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)ptr[i & 1], dims, strides, i < 2 ? box : box_t, estr,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            return false;
    return true;
}

#define PD_FA_CASE(F)                        \
    if (fl == (F)) {                         \
        pd_fa_launch<HD, (F)>(p, s, tm);     \
        return;                              \
    }

// The instantiated flag sets; anything else runs the default.
template <int HD>
static void pd_fa_dispatch(const pd_attention_kparams *p, cudaStream_t s, int fl, const CUtensorMap *tm) {
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_ARV | PD_FA_LKF)  // default, hd 128
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS | PD_FA_RSC | PD_FA_MB | PD_FA_RSE)  // the default at head_dim 64
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB)  // session 14's defaults
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS | PD_FA_RSC | PD_FA_MB)
    // session 15 variants (measurements)
#define PD_FA_S15(F)                                                    \
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | (F)) \
    PD_FA_CASE(PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | (F))
    PD_FA_S15(0)
    PD_FA_S15(PD_FA_ARV)
    PD_FA_S15(PD_FA_ARV | PD_FA_LKF)
    PD_FA_S15(PD_FA_ARV | PD_FA_LKF | PD_FA_DSC)
    PD_FA_S15(PD_FA_ARV | PD_FA_LKF | PD_FA_PERS)
    PD_FA_S15(PD_FA_ARV | PD_FA_PERS)
#undef PD_FA_S15
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_LKF)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_MB)
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS | PD_FA_MB)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL)  // session 13's default at head_dim 128
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS)  // and at 64
    PD_FA_CASE(PD_FA_PP)
    PD_FA_CASE(PD_FA_PP | PD_FA_TMA)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_TMA)
    PD_FA_CASE(PD_FA_OVL | PD_FA_TMA)
    PD_FA_CASE(0)
    PD_FA_CASE(PD_FA_TMA)
    PD_FA_CASE(PD_FA_ROWP)
    PD_FA_CASE(PD_FA_PP | PD_FA_ROWP)
    PD_FA_CASE(PD_FA_OVL)
    PD_FA_CASE(PD_FA_PP | PD_FA_ARV)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_ARV)
    PD_FA_CASE(PD_FA_ARV)
    PD_FA_CASE(PD_FA_OVL | PD_FA_ARV)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_KVS)
    PD_FA_CASE(PD_FA_OVL | PD_FA_KVS | PD_FA_RSC)
    if constexpr (HD == 128) {
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_TMAH | PD_FA_RSC | PD_FA_MB | PD_FA_RSE)
        PD_FA_CASE(PD_FA_VN64 | PD_FA_PP | PD_FA_OVL)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_TMAH)
        PD_FA_CASE(PD_FA_VN64)
        PD_FA_CASE(PD_FA_VN64 | PD_FA_PP)
    }
#ifdef PD_FA3_DIAG
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_NOLOAD)
    PD_FA_CASE(PD_FA_PP | PD_FA_NOLOAD)
    PD_FA_CASE(PD_FA_PP | PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_PP | PD_FA_TMA | PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_NOLOAD)
    PD_FA_CASE(PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_TMA | PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_OVL | PD_FA_NOLOAD)
    PD_FA_CASE(PD_FA_OVL | PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_NOMATH)
    PD_FA_CASE(PD_FA_OVL | PD_FA_NOSYNC)
    if constexpr (HD == 128) {
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_NOSYNC)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_NOLOAD)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_NOLOAD)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_NOLOAD)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_ARV | PD_FA_LKF | PD_FA_NOLOAD)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_NOMATH)
        PD_FA_CASE(PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_ARV | PD_FA_LKF | PD_FA_NOMATH)
    }
#endif
    // The other variants are built without RSC and MB (on by default): those two dropped, then the default
    if (fl & (PD_FA_RSC | PD_FA_MB)) {
        pd_fa_dispatch<HD>(p, s, fl & ~(PD_FA_RSC | PD_FA_MB), tm);
        return;
    }
    static bool warned = false;
    if (!warned)
        fprintf(stderr, "pdserve: prefill attention: the PD_CUDA_FA3_* combination (flags 0x%x) is not built: the default "
                        "kernel runs\n", fl);
    warned = true;
    pd_fa_launch<HD, HD == 128 ? PD_FA_PP | PD_FA_OVL | PD_FA_RSC | PD_FA_MB | PD_FA_RSE | PD_FA_ARV | PD_FA_LKF
                               : PD_FA_OVL | PD_FA_KVS | PD_FA_RSC | PD_FA_MB | PD_FA_RSE>(p, s, tm);
}

extern "C" int pd_cuda_attn_prefill_fa3(const pd_attention_kparams *p, cudaStream_t s) {
    if (!pd_fa_enabled() || p->kv_fp8 || p->max_q_len <= 1) return 0;
    if (p->head_dim != 64 && p->head_dim != 128) return 0;
    if ((long)((p->max_q_len + PD_FA_BQ - 1) / PD_FA_BQ) * p->n_seqs * p->n_heads > 0x7fffffffL) return 0;
    int fl = pd_fa_flags(p->head_dim);
    CUtensorMap tm[4];
    memset(tm, 0, sizeof tm);
    // TMA moves whole pages: block_size 8..128 dividing the 128-position tile (else cp.async only)
    if (fl & (PD_FA_TMA | PD_FA_TMAH)) {
        bool bs_ok = p->block_size >= 8 && p->block_size <= 128 && 128 % p->block_size == 0;
        if (bs_ok && !pd_fa_tensor_maps(p, tm)) {
            static int warned = 0;
            if (!warned) fprintf(stderr, "pdserve: PD_CUDA_FA3_TMA=1 but no tensor map could be made: cp.async only\n");
            warned = 1;
            bs_ok = false;
        }
        if (!bs_ok) fl &= ~(PD_FA_TMA | PD_FA_TMAH);
    }
    if (p->head_dim == 64) pd_fa_dispatch<64>(p, s, fl, tm);
    else pd_fa_dispatch<128>(p, s, fl, tm);
    return 1;
}
