// gemm.c — pd_op_matmul on CUDA: out (M, N) = a (M, K) . w(N, K)^T [+ bias] [+ out].
//
// The fused forms (norm_w, glu, residual, rope: backend.h) go to fused_matmul. Four paths, picked
// per shape:
//   * M <= 16 with PD_CUDA_SKINNY=1 (the default: the measured rule, see skinny_rule) or 2: the skinny
//     weight-streaming kernels (no workspace, PDL, weights prefetched before the wait), per M
//     either kernels/skinny.cu (M <= 8, f32 FMAs on the CUDA cores) or kernels/skinny_mma.cu
//     (M <= 16, tensor cores); see skinny_choice;
//   * M <= gemv_max_m (decode; off by default, see pd_cuda_gemm_init): the skinny tensor-core
//     kernel in kernels/gemv.cu, which streams the weight once over a stream-K split and is
//     launched with PDL (its weight loads start during the previous kernel); its split-K scratch
//     (cb->gemv_ws) is zeroed when allocated and left zero by every launch;
//   * otherwise cuBLASLt: bf16 A/B, fp32 compute, bf16 or f32 D, the bias epilogue when bias !=
//     NULL and beta = 1 for accumulate. Row-major out = a.w^T is column-major out^T = w^T.a^T,
//     so cuBLASLt sees A = w (K x N, ld K, transposed), B = a (K x M, ld lda), D = out (N x M, ld N).
// The descriptors and the heuristic's algorithm are cached per (M, N, K, lda, flags): building
// them costs tens of microseconds, a lookup is a short linear scan (a model has ~10 shapes).
// Decode shapes with 32 <= M <= 128 (batched decode) are tuned once when their plan is built: up
// to 32 of the heuristic's candidates are timed with cudaEvents on the call's own operands (output
// to a scratch buffer, L2 flushed before each rep, so a weight that fits in L2 is not timed hot)
// and the fastest is kept; tens of milliseconds per shape on its first call, never during graph
// capture (the eager warm-up step builds every plan first). On an H200 this took Llama-3-8B
// batch-64 decode from 6.34 to 6.23 ms; for M < 32 the heuristic's first choice was as good
// (tools/gpu/NOTES.md). Session 10 (H100, call b64-2) widened it from M <= 64 and 8 candidates to
// M <= 128 and 32: batch 128 9.68 vs 9.91-10.04 ms, batch 64 7.76 vs 7.79-7.86, others level.
// PD_CUDA_GEMM_TUNE=1 tunes every M up to the bound, =0 none; PD_CUDA_GEMM_TUNE_MAX_M and
// PD_CUDA_GEMM_TUNE_ALGOS set the bound and the candidate count. Prefill shapes may be tuned
// differently (gemm_tune_pf, PD_CUDA_GEMM_TUNE_PF: off by default; measured unreliable).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_impl.h"
#include "base/buf.h"
#include "kernels/add_bias.cuh"
#include "kernels/bgemm.cuh"
#include "kernels/gemv.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_kv.cuh"
#include "kernels/silu_mul.cuh"
#include "kernels/skinny.cuh"
#include "kernels/skinny_mma.cuh"

#define PD_CUDA_LT_WS_BYTES (32u << 20)
#define PD_GEMM_TUNE_MIN_M 32  // default tuning range: PD_GEMM_TUNE_MIN_M <= M <= PD_GEMM_TUNE_MAX_M
#define PD_GEMM_TUNE_MAX_M 128
#define PD_GEMM_TUNE_ALGOS 32      // default candidates timed (PD_CUDA_GEMM_TUNE_ALGOS: 1..PD_GEMM_TUNE_ALGOS_MAX)
#define PD_GEMM_TUNE_ALGOS_MAX 32
#define PD_GEMM_TUNE_REPS 6
#define PD_GEMM_FLUSH_BYTES (192u << 20)  // > L2 (50 MB on H100/H200) with margin
#define PD_GEMM_TUNE_PF_ALGOS 8
#define PD_GEMM_TUNE_PF_ROUNDS 3
#define PD_GEMM_PICK_MIN_M 256  // PD_CUDA_GEMM_PF_PICK applies from this M

struct pd_cuda_gemm_plan {
    int M, N, K, lda, flags;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
};

enum { PD_GEMM_BIAS = 1, PD_GEMM_F32 = 2 };


void pd_cuda_gemm_init(pd_cuda_backend *cb) {
    PD_CUBLAS_CHECK(cublasLtCreate(&cb->lt));
    cb->lt_ws_bytes = PD_CUDA_LT_WS_BYTES;
    PD_CUDA_CHECK(cudaMalloc(&cb->lt_ws, cb->lt_ws_bytes));
    // Measured on an H200 (tools/gpu/NOTES.md, "decode speed"): the stream-K skinny kernel with PDL
    // and bulk copies reached 2.2-3.6 TB/s on the Llama-3-8B decode shapes (lm_head 4.2), cuBLASLt
    // 2.4-4.1, and 8B single-stream decode took 5.11 ms with it against 4.49 ms with cuBLASLt. So
    // cuBLASLt is the default; PD_CUDA_GEMV_MAX_M=16 selects the kernel (measurements, other cards).
    cb->gemv_max_m = 0;
    const char *e = getenv("PD_CUDA_GEMV_MAX_M");  // tuning knob for measurements
    if (e && *e) cb->gemv_max_m = atoi(e);
    // The skinny kernels (kernels/skinny.cu, M <= 8; kernels/skinny_mma.cu, M <= 16):
    // PD_CUDA_SKINNY=0 off, 1 (the default) the measured per-shape rule of skinny_choice, 2 every
    // supported call (tests, op_bench);
    // PD_CUDA_SKINNY_ROWS=2 selects 2 weight rows per block instead of 4 (measurements).
    cb->skinny = pd_cuda_env_int("PD_CUDA_SKINNY", 1, 0, 2);
    cb->skinny_rows = pd_cuda_env_int("PD_CUDA_SKINNY_ROWS", 4, 2, 4);
    // PD_CUDA_SKINNY_OCC4=1: at M = 5 the CUDA-core kernel's build bounded to 128 registers, 4
    // blocks (128 KB of weight loads in flight) per SM instead of 3. Measurement knob (H100: a fused
    // layer at M = 5 171.4 vs 168.4 us: occupancy is not what limits it).
    cb->skinny_occ4 = pd_cuda_env_int("PD_CUDA_SKINNY_OCC4", 0, 0, 1);
    cb->skinny_rule_max_m = pd_cuda_env_int("PD_CUDA_SKINNY_RULE_MAX_M", 5, 1, PD_SKINNY_MAX_M);  // skinny_rule's M cut
    // PD_CUDA_SKINNY_ASYNC=1: the CUDA-core kernel copies its weights into shared memory with
    // cp.async instead of loading them into registers (more blocks, so more bytes in flight, per SM
    // at M >= 5). Measurement knob (H100: slower at every M, 160.3 vs 152.3 us a layer at M = 1,
    // 207.2 vs 168.4 at M = 5).
    cb->skinny_async = pd_cuda_env_int("PD_CUDA_SKINNY_ASYNC", 0, 0, 1);
    // PD_CUDA_SKINNY_PREWAIT=u: the CUDA-core kernel issues only the first u of a block's U batches
    // of weight loads before the PDL wait, the rest right after it (-1, the default: all before).
    // Measurement knob (kernels/skinny.cu "Prewait": 0 costs 170 us a single-stream step, 2 level).
    cb->skinny_prewait = pd_cuda_env_int("PD_CUDA_SKINNY_PREWAIT", -1, -1, 16) + 1;
    // PD_CUDA_SKINNY_NORM_PF: the CUDA-core kernel's fused norm weight (chunks of a block's first
    // batch) prefetched before the PDL wait into L1 (1, the default) or L2 (2), or not (0):
    // kernels/skinny.cu "Norm prefetch" (H100, session 14: single stream ctx 128 -35 to -63 us a step).
    cb->skinny_norm_pf = pd_cuda_env_int("PD_CUDA_SKINNY_NORM_PF", 1, 0, 2);
    if (cb->skinny_rows == 3) pd_abort(__FILE__, __LINE__, __func__, "PD_CUDA_SKINNY_ROWS must be 2 or 4");
    // Which of the two skinny kernels takes an M (see skinny_choice): PD_CUDA_SKINNY_MMA=0 the
    // CUDA-core kernel only (M <= 8; larger M go to cuBLASLt), 1 (the default) the rule measured end
    // to end (CUDA cores to M = 5, no tensor cores), 2 the tensor-core kernel for every M <= 16
    // (tests, op_bench), 3 op_bench's per-(M, shape) winners (tensor cores from M = 6).
    // PD_CUDA_SKINNY_MMA_ROWS=32 gives the tensor-core kernel 32 weight rows per block instead of
    // 16; PD_CUDA_SKINNY_MMA_PIPE=0/1 forces its double-buffered weight loads off/on (default: the
    // rule's choice). Measurement knobs.
    cb->skinny_mma = pd_cuda_env_int("PD_CUDA_SKINNY_MMA", 1, 0, 3);
    cb->skinny_mma_rows = pd_cuda_env_int("PD_CUDA_SKINNY_MMA_ROWS", 16, 16, 32);
    if (cb->skinny_mma_rows != 16 && cb->skinny_mma_rows != 32)
        pd_abort(__FILE__, __LINE__, __func__, "PD_CUDA_SKINNY_MMA_ROWS must be 16 or 32");
    cb->skinny_mma_pipe = pd_cuda_env_int("PD_CUDA_SKINNY_MMA_PIPE", -1, -1, 1);
    // PD_CUDA_SKINNY_MMA_LOADS=32: 32 weight loads in flight per thread instead of 16 (16-row
    // blocks; small grids: N = 4096 is 256 blocks, 2 per SM). Measurement knob (H100 and H200:
    // slower to M = 8, level from 9).
    cb->skinny_mma_loads = pd_cuda_env_int("PD_CUDA_SKINNY_MMA_LOADS", 16, 16, 32);
    if (cb->skinny_mma_loads != 16 && cb->skinny_mma_loads != 32)
        pd_abort(__FILE__, __LINE__, __func__, "PD_CUDA_SKINNY_MMA_LOADS must be 16 or 32");
    // Fused decode layers (pd_backend_fuses_matmul; backend.h "Fused forms"): decode steps of
    // M <= PD_CUDA_SKINNY_FUSE_MAX_M tokens (default 4) run their layers as 5 kernels, RoPE + KV
    // write, SwiGLU and residual adds folded into skinny GEMMs, and the norms too for M <=
    // PD_CUDA_FUSE_NORM_MAX_M (default 2; above, the rmsnorm kernel runs before the GEMM). On by
    // default; PD_CUDA_SKINNY_FUSE=0 turns it off. Measured on an H100 (session 9 calls fuse-1/2,
    // tools/gpu/NOTES.md): Llama-3-8B single stream 5.34 ms vs 5.48 unfused (skinny) at context
    // 128; one layer minus attention (op_bench fuse) unfused / fused / fused with the norm
    // unfolded: M = 1 160.2 / 152.5 / 155.3 us, M = 2 164.0 / 157.6 / 158.9, M = 4 169.4 / 169.5 /
    // 164.4, M = 8 201.5 / 274.2 / 202.2 (the norm computed on the fly makes the kernel issue-bound
    // from 4 rows; at 8 the skinny kernel itself loses to cuBLASLt, gemv call A). The fused forms
    // themselves run on the skinny kernel whenever it supports the call.
    // (above 8 rows, or 4 rows with the norm folded, without PD_CUDA_FUSE_MMA_MIN_M: the parts the
    // CUDA-core kernel cannot take run unfused, correct but slower.)
    cb->skinny_fuse = pd_cuda_env_int("PD_CUDA_SKINNY_FUSE", 1, 0, 1) ? pd_cuda_env_int("PD_CUDA_SKINNY_FUSE_MAX_M", 4, 1, PD_SKINNY_MMA_MAX_M) : 0;
    cb->fuse_norm_max_m = pd_cuda_env_int("PD_CUDA_FUSE_NORM_MAX_M", 2, 0, PD_SKINNY_MAX_M);
    // Measurement knobs, each 0 runs that part as its own kernel around the skinny GEMM:
    // PD_CUDA_FUSE_ROPE (rope_kv), PD_CUDA_FUSE_NORM (rmsnorm), PD_CUDA_FUSE_GLU (silu_mul).
    cb->fuse_rope = pd_cuda_env_int("PD_CUDA_FUSE_ROPE", 1, 0, 1);
    if (!pd_cuda_env_int("PD_CUDA_FUSE_NORM", 1, 0, 1)) cb->fuse_norm_max_m = 0;
    cb->fuse_glu = pd_cuda_env_int("PD_CUDA_FUSE_GLU", 1, 0, 1);
    // Fused forms on the tensor-core kernel (kernels/skinny_mma.cu: its cost does not grow with M,
    // the CUDA-core kernel's does): M >= PD_CUDA_FUSE_MMA_MIN_M (0: never) runs the fused GEMMs
    // there, the norm as its own kernel before; up to M = 16, so PD_CUDA_SKINNY_FUSE_MAX_M may go to
    // 16 with it. Speculative verify steps at batch 1 (M = k + 1). Off by default: measured (session
    // 10, docs/benchmarks.md) with MIN_M 5 / FUSE_MAX_M 16 on an H100, 0.2% off a 5-token verify
    // step, 3.2% off a 9-token one, 2.6% off a batch-8 decode step (171 vs 187 us a layer at M = 8);
    // on an H200 7-12% slower at M = 8-16 than cuBLASLt.
    cb->fuse_mma_min_m = pd_cuda_env_int("PD_CUDA_FUSE_MMA_MIN_M", 0, 0, PD_SKINNY_MMA_MAX_M);
    // Which fused forms go there (a mask of FUSE_MMA_*: 1 the qkv GEMM with RoPE, 2 residual (o,
    // down), 4 SwiGLU (gate_up), 8 the rest (the lm_head with its norm); default 7: the lm_head
    // stays on the CUDA-core kernel, which streams it faster to M = 7: 334 vs 350 us at M = 5, op_bench
    // gemv, session 9). From 8 rows every form goes there (the CUDA-core kernel is issue-bound).
    cb->fuse_mma_forms = pd_cuda_env_int("PD_CUDA_FUSE_MMA_FORMS", 7, 0, 15);
    // The batched-decode GEMM (kernels/bgemm.cu) for 17 <= M <= 64, with the SwiGLU in gate_up's
    // epilogue and RoPE + KV write in qkv's (pd_backend_fuses_epilogues): PD_CUDA_BGEMM=1 on, 0 (the
    // default) cuBLASLt + silu_mul + rope_kv. Off because it measured slower than cuBLASLt
    // (session 10, H200: batch-64 decode step 8.26 vs 5.86 ms; qkv 43 vs 16 us, gate_up + SwiGLU
    // 72 vs 59 + 2.5 us: the mma.sync + cp.async main loop streams at ~81% of the copy rate at
    // best, cuBLASLt's TMA + wgmma kernels at 99%; see tools/gpu/NOTES.md session 10).
    // PD_CUDA_FUSE_ROPE=0 keeps rope_kv a kernel of its own here too.
    cb->bgemm = pd_cuda_env_int("PD_CUDA_BGEMM", 0, 0, 1);
    cb->bgemm_per_sm = pd_cuda_env_int("PD_CUDA_BGEMM_PER_SM", 2, 1, 2);  // its split-K sizing (measurements)
    cb->bgemm_stages = pd_cuda_env_int("PD_CUDA_BGEMM_STAGES", 4, 4, 8);   // its ring depth: 4 or 8 (measurements)
    if (cb->bgemm_stages != 4 && cb->bgemm_stages != 8) pd_abort(__FILE__, __LINE__, __func__, "PD_CUDA_BGEMM_STAGES must be 4 or 8");
    // cuBLASLt tuning of decode shapes (tune_enabled, gemm_tune): PD_CUDA_GEMM_TUNE unset (-1) the
    // default range, 1 every M up to the bound, 0 none; the bound and the candidates timed.
    cb->tune = pd_cuda_env_int("PD_CUDA_GEMM_TUNE", -1, 0, 1);
    cb->tune_max_m = pd_cuda_env_int("PD_CUDA_GEMM_TUNE_MAX_M", PD_GEMM_TUNE_MAX_M, 1, 65536);
    cb->tune_algos = pd_cuda_env_int("PD_CUDA_GEMM_TUNE_ALGOS", PD_GEMM_TUNE_ALGOS, 1, PD_GEMM_TUNE_ALGOS_MAX);
    // Prefill shapes (gemm_tune_pf): M >= PD_CUDA_GEMM_TUNE_PF above the decode range (default 0:
    // off; measurement knob, see gemm_tune_pf), PD_CUDA_GEMM_TUNE_PF_ALGOS candidates (default 8).
    cb->tune_pf_min_m = pd_cuda_env_int("PD_CUDA_GEMM_TUNE_PF", 0, 0, 1 << 30);
    cb->tune_pf_algos = pd_cuda_env_int("PD_CUDA_GEMM_TUNE_PF_ALGOS", PD_GEMM_TUNE_PF_ALGOS, 1, PD_GEMM_TUNE_ALGOS_MAX);
    // PD_CUDA_GEMM_PF_PICK=k (measurement knob, default -1: off): untuned cuBLASLt plans of M >=
    // PD_GEMM_PICK_MIN_M (prefill shapes) take the heuristic's candidate k (its last when it offers
    // fewer) instead of its first, and every such plan's choice is printed (stderr) with its
    // configuration: candidates compared inside the engine's own prefill (bench-engine
    // PD_CUDA_PROF=1 gives each shape's time there), where the card runs at its power limit.
    cb->pf_pick = pd_cuda_env_int("PD_CUDA_GEMM_PF_PICK", -1, -1, PD_GEMM_TUNE_ALGOS_MAX - 1);
}

// One line on stderr: the algorithm's configuration (cublasLtMatmulAlgoConfigGetAttribute).
static void algo_print(const pd_cuda_gemm_plan *pl, int pick, int n_res, const cublasLtMatmulHeuristicResult_t *r) {
    static const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
        CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID};
    static const char *names[] = {"id", "tile", "stages", "cluster", "splitk", "reduction", "swizzle", "custom", "inner"};
    fprintf(stderr, "cuBLASLt plan M=%d N=%d K=%d flags=%d: candidate %d of %d (workspace %zu B, waves %.2f):", pl->M, pl->N,
            pl->K, pl->flags, pick, n_res, r->workspaceSize, r->wavesCount);
    for (size_t i = 0; i < PD_ARRAY_LEN(attrs); i++) {
        uint32_t v = 0;  // every one of these attributes is 32 bits or less
        size_t got = 0;
        if (cublasLtMatmulAlgoConfigGetAttribute(&r->algo, attrs[i], &v, sizeof v, &got) == CUBLAS_STATUS_SUCCESS)
            fprintf(stderr, " %s=%u", names[i], v);
    }
    fprintf(stderr, "\n");
}

bool pd_cuda_gemm_fuses(pd_backend *b, int M) {  // (PD_CUDA_SKINNY=0: no skinny kernel, no fused forms)
    const pd_cuda_backend *cb = pd_cuda_backend_of(b);
    return cb->skinny > 0 && M >= 1 && M <= cb->skinny_fuse;
}

bool pd_cuda_gemm_fuses_epilogues(pd_backend *b, int M) {
    const pd_cuda_backend *cb = pd_cuda_backend_of(b);
    return cb->bgemm > 0 && M >= PD_BGEMM_MIN_M && M <= PD_BGEMM_MAX_M;
}

// The batched-decode GEMM on q (plain or glu; the caller checked pd_cuda_bgemm_supported).
static void bgemm_run(pd_cuda_backend *cb, const pd_matmul_params *q, int lda) {
    pd_cuda_scratch_reserve_zeroed(cb, &cb->bgemm_ws, &cb->bgemm_ws_bytes,
                                   pd_cuda_bgemm_workspace_bytes(q->N, q->glu, 2));
    pd_bgemm_kparams k = {.a = q->a, .w = q->w, .bias = q->bias, .out = q->out, .M = q->M, .N = q->N, .K = q->K,
                          .lda = lda, .accumulate = q->accumulate, .out_f32 = q->out_f32, .glu = q->glu,
                          .per_sm = cb->bgemm_per_sm, .stages = cb->bgemm_stages, .ws = cb->bgemm_ws};
    if (q->rope) {
        const pd_rope_kv_params *rp = q->rope;
        k.rope = 1, k.positions = rp->positions, k.slot_mapping = rp->slot_mapping, k.inv_freq = rp->inv_freq;
        k.k_cache = rp->k_cache, k.v_cache = rp->v_cache, k.n_heads = rp->n_heads, k.n_kv_heads = rp->n_kv_heads;
        k.attn_scaling = rp->attn_scaling;
    }
    pd_cuda_bgemm(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
}

enum { SKINNY_NONE, SKINNY_CORES, SKINNY_MMA, SKINNY_MMA_PIPE };

// Two rules for mode 1 (N, K >= 2048), both measured on an H100 SXM (tools/gpu/NOTES.md, session
// 9 "mma": `op_bench gemv` per shape, `bench-engine --only verify` end to end, Llama-3-8B).
//
// skinny_rule_ops (PD_CUDA_SKINNY_MMA=3): the per-shape winners of op_bench, times in us at M = 5 /
// 8 / 9 for cuBLASLt, CUDA-core, tensor-core, tensor-core double-buffered:
//   * long K (down, 4096 x 14336): the CUDA-core kernel to M = 4 (43.4 vs 45.0), then cuBLASLt
//     (45.2 vs 46.0 / 45.8 / 48.3 at M = 5; 45.5 vs 52.0 / 51.0 at M = 9): 256 blocks of 16 rows x
//     28 KB are too coarse for the tensor-core kernel;
//   * M <= 5: the CUDA-core kernel (o: 14.6 vs 16.8 / 15.9 / 15.3; lm_head 334 vs 380 / 350);
//   * N <= 8192 (qkv, o), M = 6..16: tensor cores double-buffered (qkv 19.8-20.7 vs cuBLASLt
//     22.3-22.5; o 15.3-15.8 vs 16.7-17.0);
//   * larger N (gate_up, lm_head): the CUDA-core kernel to M = 7, then tensor cores single-buffered
//     (lm_head 350.8-355.4 vs 378-380; gate_up ties cuBLASLt: 83.5-85.4 vs 83.7-87.1).
// End to end it did not win where it uses tensor cores: verify steps at M = 9 (batch 1) 6.35-6.46 ms
// vs 6.34-6.45 with cuBLASLt, M = 8 (batch 8) 6.480 vs 6.486, M = 16 (batch 8) 6.651 vs 6.540,
// although op_bench's sums predicted 0.07-0.2 ms less (not understood; the same comparison for
// the CUDA-core kernel at M = 1..8 and for tensor cores everywhere at M = 1 matched op_bench).
//
// skinny_rule (PD_CUDA_SKINNY_MMA=1, the default) keeps what won end to end: the CUDA-core kernel
// to M = 5 (M = 4 for long K), cuBLASLt above. Verify steps at M = 5 (batch 1, 3-4 drafts):
// 6.016-6.028 ms against 6.278-6.290 with cuBLASLt and 6.079-6.086 with the CUDA-core kernel on
// every shape; at M = 8 the CUDA-core kernel was 0.5 ms slower than cuBLASLt (6.982 vs 6.486).
// max_m: PD_CUDA_SKINNY_RULE_MAX_M (default 5; 4 sends M = 5 to cuBLASLt, which an H200 ran faster:
// session 10 call 1, op_bench fusev 136.7 vs 140.5 us a layer at M = 5; an H100 slower: a 5-token
// verify step 6.259 vs 6.037 ms, call 2).
static int skinny_rule(int M, int N, int K, int max_m) {
    (void)N;
    if (K > 8192) return M <= PD_MIN(4, max_m) ? SKINNY_CORES : SKINNY_NONE;
    return M <= max_m ? SKINNY_CORES : SKINNY_NONE;
}

static int skinny_rule_ops(int M, int N, int K) {
    if (K > 8192) return M <= 4 ? SKINNY_CORES : SKINNY_NONE;
    if (M <= 5) return SKINNY_CORES;
    if (N <= 8192) return SKINNY_MMA_PIPE;
    return M <= 7 ? SKINNY_CORES : SKINNY_MMA;
}

// Which skinny kernel takes this call, if any (see pd_cuda_gemm_init for the modes). Mode 1 first
// asks for decode-sized weights (N, K >= 2048: grids of >= 128 blocks, every SM streaming; small N
// gives too few blocks without a split-K, which neither kernel has), then follows
// PD_CUDA_SKINNY_MMA: 0 the CUDA-core kernel to M = 8 (session 8), 1 skinny_rule, 2 the tensor-core
// kernel, 3 skinny_rule_ops. Mode 2 takes every supported call: the CUDA-core kernel to M = 8 unless
// PD_CUDA_SKINNY_MMA=2, the tensor-core kernel above (unless =0). An M no kernel takes goes to
// cuBLASLt.
static int skinny_choice(const pd_cuda_backend *cb, const pd_matmul_params *p, int lda) {
    if (cb->skinny <= 0 || p->M > PD_SKINNY_MMA_MAX_M) return SKINNY_NONE;
    if (cb->skinny == 1 && !(p->N >= 2048 && p->K >= 2048)) return SKINNY_NONE;
    int k;
    if (cb->skinny == 1 && cb->skinny_mma == 1) k = skinny_rule(p->M, p->N, p->K, cb->skinny_rule_max_m);
    else if (cb->skinny == 1 && cb->skinny_mma == 3) k = skinny_rule_ops(p->M, p->N, p->K);
    else if (cb->skinny_mma == 2 || (cb->skinny >= 2 && cb->skinny_mma != 0 && p->M > PD_SKINNY_MAX_M)) k = SKINNY_MMA;
    else k = SKINNY_CORES;
    if (k == SKINNY_NONE) return k;
    if (k == SKINNY_CORES) return pd_cuda_skinny_supported(p->M, p->K, lda, p->a, p->w) ? k : SKINNY_NONE;
    if (!pd_cuda_skinny_mma_supported(p->M, p->K, lda, p->a, p->w)) return SKINNY_NONE;
    if (cb->skinny_mma_pipe >= 0) return cb->skinny_mma_pipe ? SKINNY_MMA_PIPE : SKINNY_MMA;
    return k;
}

void pd_cuda_gemm_fini(pd_cuda_backend *cb) {
    for (int i = 0; i < cb->n_plans; i++) {
        pd_cuda_gemm_plan *pl = &cb->plans[i];
        cublasLtMatrixLayoutDestroy(pl->la);
        cublasLtMatrixLayoutDestroy(pl->lb);
        cublasLtMatrixLayoutDestroy(pl->lc);
        cublasLtMatmulDescDestroy(pl->desc);
    }
    pd_free(cb->plans);
    if (cb->lt_ws) cudaFree(cb->lt_ws);
    if (cb->lt) cublasLtDestroy(cb->lt);
}

// Whether a plan of M rows is tuned (the knobs of pd_cuda_gemm_init): PD_CUDA_GEMM_TUNE unset
// PD_GEMM_TUNE_MIN_M <= M <= the bound, =1 every M up to the bound, =0 none.
static bool tune_enabled(const pd_cuda_backend *cb, int M) {
    if (M > cb->tune_max_m || cb->tune == 0) return false;
    return cb->tune == 1 || M >= PD_GEMM_TUNE_MIN_M;
}

// Times the candidates on p's operands and keeps the fastest in pl->algo. Best effort: any
// allocation failure leaves the heuristic's first choice.
static void gemm_tune(pd_cuda_backend *cb, pd_cuda_gemm_plan *pl, const cublasLtMatmulHeuristicResult_t *res, int n_res,
                      const pd_matmul_params *p) {
    size_t out_bytes = (size_t)pl->M * (size_t)pl->N * ((pl->flags & PD_GEMM_F32) ? 4 : 2);
    void *out = NULL, *flush = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (cudaMalloc(&out, out_bytes) != cudaSuccess || cudaMalloc(&flush, PD_GEMM_FLUSH_BYTES) != cudaSuccess ||
        cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
        cudaGetLastError();
        PD_LOG_D("cuBLASLt: no memory to tune M=%d N=%d K=%d; using the heuristic's choice", pl->M, pl->N, pl->K);
        goto done;
    }
    PD_CUDA_CHECK(cudaMemsetAsync(out, 0, out_bytes, cb->stream));
    if (pl->flags & PD_GEMM_BIAS)
        PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias, sizeof p->bias));
    float alpha = 1.0f, beta = p->accumulate ? 1.0f : 0.0f, best = INFINITY, first = 0;
    int best_i = 0;
    for (int i = 0; i < n_res; i++) {
        float total = 0;
        bool ok = true;
        for (int r = 0; r <= PD_GEMM_TUNE_REPS && ok; r++) {  // rep 0 warms up
            PD_CUDA_CHECK(cudaMemsetAsync(flush, r, PD_GEMM_FLUSH_BYTES, cb->stream));
            PD_CUDA_CHECK(cudaEventRecord(e0, cb->stream));
            ok = cublasLtMatmul(cb->lt, pl->desc, &alpha, p->w, pl->la, p->a, pl->lb, &beta, out, pl->lc, out, pl->lc,
                                &res[i].algo, cb->lt_ws, cb->lt_ws_bytes, cb->stream) == CUBLAS_STATUS_SUCCESS;
            PD_CUDA_CHECK(cudaEventRecord(e1, cb->stream));
            PD_CUDA_CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            PD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r > 0) total += ms;
        }
        if (i == 0) first = total;
        if (ok && total < best) best = total, best_i = i;
    }
    pl->algo = res[best_i].algo;
    PD_LOG_D("cuBLASLt: M=%d N=%d K=%d: candidate %d of %d, %.1f us (heuristic's first %.1f us)", pl->M, pl->N, pl->K,
             best_i, n_res, 1e3 * best / PD_GEMM_TUNE_REPS, 1e3 * first / PD_GEMM_TUNE_REPS);
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (out) cudaFree(out);
    if (flush) cudaFree(flush);
}

// Prefill shapes (M >= cb->tune_pf_min_m, compute-bound): the heuristic's first choice ran the
// Llama-3-8B qkv GEMM at M = 8192 at 81% of the 8192^3 peak where another candidate ran 94.5%
// (H100, op_bench pfl, session 11); gemm_tune's short, L2-flushed timings picked slower kernels for
// gate_up and o there (a GPU that just idled through the flush runs its first milliseconds at
// clocks it cannot hold: short bursts rank kernels by something else than sustained speed). So the
// candidates run back to back, warm, interleaved over PD_GEMM_TUNE_PF_ROUNDS rounds (each round
// times every candidate once: clock drift hits them alike), and the fastest total wins. The choice
// is kept per (N, K, lda, flags, power-of-two bucket of M) and reused, after
// cublasLtMatmulAlgoCheck, by every later M of the bucket: a server's prompt lengths vary, and
// tuning each (tens of ms at 8k) would cost every new length. Best effort: an allocation failure
// leaves the heuristic's choice.
// Off by default (PD_CUDA_GEMM_TUNE_PF=1024 turns it on from M = 1024): measured on an H100
// (session 11, tools/gpu/NOTES.md pf11-2) it did pick qkv's faster kernel at 8192 (547 vs 627 us,
// and 147 vs 154 at 2048), but also a slower one for the 8192^3 GEMM that bench-engine measures as
// its peak (681-727 TFLOP/s in every run with it against 780-786 without): a single interleaved
// run per candidate still ranks by something else than sustained speed, and prefill times moved
// within the noise (8192 tokens 230.9 ms without vs 229.5 with). A robust ranking needs long
// sustained runs per candidate (hundreds of ms per shape) or offline tables; not done.
static int pf_bucket(int M) {
    int b = 1;
    while (b < M && b < (1 << 30)) b <<= 1;
    return b;
}
static void gemm_tune_pf(pd_cuda_backend *cb, pd_cuda_gemm_plan *pl, const cublasLtMatmulHeuristicResult_t *res,
                         int n_res, const pd_matmul_params *p) {
    int bucket = pf_bucket(pl->M);
    for (int i = 0; i < cb->n_pf_algos; i++) {
        struct pd_cuda_pf_algo *e = &cb->pf_algos[i];
        if (e->N != pl->N || e->K != pl->K || e->lda != pl->lda || e->flags != pl->flags || e->bucket != bucket) continue;
        cublasLtMatmulHeuristicResult_t chk;
        if (cublasLtMatmulAlgoCheck(cb->lt, pl->desc, pl->la, pl->lb, pl->lc, pl->lc, &e->algo, &chk) ==
            CUBLAS_STATUS_SUCCESS) {
            pl->algo = e->algo;
            return;
        }
    }
    size_t out_bytes = (size_t)pl->M * (size_t)pl->N * ((pl->flags & PD_GEMM_F32) ? 4 : 2);
    void *out = NULL;
    cudaEvent_t ev[2 * PD_GEMM_TUNE_ALGOS_MAX];
    int n_ev = 0, best_i = 0;
    float tot[PD_GEMM_TUNE_ALGOS_MAX];
    if (n_res > 1 && cudaMalloc(&out, out_bytes) != cudaSuccess) {
        cudaGetLastError();
        out = NULL;
    }
    for (; out && n_ev < 2 * n_res; n_ev++)
        if (cudaEventCreate(&ev[n_ev]) != cudaSuccess) break;
    if (out && n_ev == 2 * n_res) {
        PD_CUDA_CHECK(cudaMemsetAsync(out, 0, out_bytes, cb->stream));
        if (pl->flags & PD_GEMM_BIAS)
            PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias, sizeof p->bias));
        float alpha = 1.0f, beta = p->accumulate ? 1.0f : 0.0f;
        for (int i = 0; i < n_res; i++) tot[i] = 0;
        for (int r = 0; r <= PD_GEMM_TUNE_PF_ROUNDS; r++) {  // round 0 warms up
            for (int i = 0; i < n_res; i++) {
                PD_CUDA_CHECK(cudaEventRecord(ev[2 * i], cb->stream));
                if (cublasLtMatmul(cb->lt, pl->desc, &alpha, p->w, pl->la, p->a, pl->lb, &beta, out, pl->lc, out, pl->lc,
                                   &res[i].algo, cb->lt_ws, cb->lt_ws_bytes, cb->stream) != CUBLAS_STATUS_SUCCESS)
                    tot[i] = INFINITY;
                PD_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], cb->stream));
            }
            PD_CUDA_CHECK(cudaEventSynchronize(ev[2 * n_res - 1]));
            for (int i = 0; i < n_res && r > 0; i++) {
                float ms = 0;
                PD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                tot[i] += ms;
            }
        }
        for (int i = 1; i < n_res; i++)
            if (tot[i] < tot[best_i]) best_i = i;
        pl->algo = res[best_i].algo;
        PD_LOG_D("cuBLASLt prefill: M=%d N=%d K=%d: candidate %d of %d, %.1f us (heuristic's first %.1f us)", pl->M,
                 pl->N, pl->K, best_i, n_res, 1e3 * tot[best_i] / PD_GEMM_TUNE_PF_ROUNDS,
                 1e3 * tot[0] / PD_GEMM_TUNE_PF_ROUNDS);
    } else if (n_res > 1) {
        PD_LOG_D("cuBLASLt: no memory to tune M=%d N=%d K=%d; using the heuristic's choice", pl->M, pl->N, pl->K);
    }
    for (int i = 0; i < n_ev; i++) cudaEventDestroy(ev[i]);
    if (out) cudaFree(out);
    if (cb->n_pf_algos < (int)PD_ARRAY_LEN(cb->pf_algos))
        cb->pf_algos[cb->n_pf_algos++] = (struct pd_cuda_pf_algo){.N = pl->N, .K = pl->K, .lda = pl->lda,
                                                                  .flags = pl->flags, .bucket = bucket, .algo = pl->algo};
}

static pd_cuda_gemm_plan *gemm_plan_build(pd_cuda_backend *cb, const pd_matmul_params *p, int lda, int flags) {
    int M = p->M, N = p->N, K = p->K;
    pd_status grown = PD_ARRAY_RESERVE(cb->plans, cb->cap_plans, (size_t)cb->n_plans + 1);
    PD_ASSERT(grown == PD_OK);
    pd_cuda_gemm_plan *pl = &cb->plans[cb->n_plans];
    *pl = (pd_cuda_gemm_plan){.M = M, .N = N, .K = K, .lda = lda, .flags = flags};
    cudaDataType_t dt = (flags & PD_GEMM_F32) ? CUDA_R_32F : CUDA_R_16BF;
    PD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&pl->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (flags & PD_GEMM_BIAS) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = CUDA_R_16BF;
        PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->la, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, K));
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->lb, CUDA_R_16BF, (uint64_t)K, (uint64_t)M, lda));
    PD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->lc, dt, (uint64_t)N, (uint64_t)M, N));
    cublasLtMatmulPreference_t pref;
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &cb->lt_ws_bytes, sizeof cb->lt_ws_bytes));
    uint32_t align = 16;  // callers pass offsets into larger buffers: promise 16 bytes, not 256
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof align));
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align, sizeof align));
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof align));
    PD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof align));
    cublasLtMatmulHeuristicResult_t res[PD_GEMM_TUNE_ALGOS_MAX];
    int n_res = 0;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    PD_CUDA_CHECK(cudaStreamIsCapturing(cb->stream, &cs));
    bool tune = cs == cudaStreamCaptureStatusNone && tune_enabled(cb, M);
    bool tune_pf = cs == cudaStreamCaptureStatusNone && !tune && cb->tune_pf_min_m > 0 && M >= cb->tune_pf_min_m;
    int pick = !tune && !tune_pf && cb->pf_pick >= 0 && M >= PD_GEMM_PICK_MIN_M ? cb->pf_pick : -1;
    int n_algos = tune ? cb->tune_algos : tune_pf ? cb->tune_pf_algos : pick >= 0 ? pick + 1 : 1;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cb->lt, pl->desc, pl->la, pl->lb, pl->lc, pl->lc, pref,
                                                       n_algos, res, &n_res);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || n_res == 0) {
        PD_LOG_E("cuBLASLt: no algorithm for M=%d N=%d K=%d lda=%d flags=%d (status %d)", M, N, K, lda, flags, (int)st);
        pd_abort(__FILE__, __LINE__, __func__, "cuBLASLt heuristic found no algorithm");
    }
    pl->algo = res[0].algo;
    if (pick >= 0) {
        pick = PD_MIN(pick, n_res - 1);
        pl->algo = res[pick].algo;
        algo_print(pl, pick, n_res, &res[pick]);
    }
    cb->n_plans++;  // counted before tuning: pl stays valid (no realloc until the next build)
    if (tune && n_res > 1) gemm_tune(cb, pl, res, n_res, p);
    else if (tune_pf) gemm_tune_pf(cb, pl, res, n_res, p);
    return pl;
}

static pd_cuda_gemm_plan *gemm_plan_get(pd_cuda_backend *cb, const pd_matmul_params *p, int lda, int flags) {
    for (int i = 0; i < cb->n_plans; i++) {
        pd_cuda_gemm_plan *pl = &cb->plans[i];
        if (pl->M == p->M && pl->N == p->N && pl->K == p->K && pl->lda == lda && pl->flags == flags) return pl;
    }
    return gemm_plan_build(cb, p, lda, flags);
}

// pd_op_rope_kv's kernel, after the GEMM that wrote rp->qkv.
static void rope_after(pd_backend *b, pd_cuda_backend *cb, const pd_rope_kv_params *rp) {
    pd_rope_kv_kparams k = {.qkv = rp->qkv, .positions = rp->positions, .inv_freq = rp->inv_freq,
                            .slot_mapping = rp->slot_mapping, .k_cache = rp->k_cache, .v_cache = rp->v_cache,
                            .n_tokens = rp->n_tokens, .n_heads = rp->n_heads, .n_kv_heads = rp->n_kv_heads,
                            .head_dim = rp->head_dim, .attn_scaling = rp->attn_scaling,
                            .kv_fp8 = rp->kv_dtype == PD_KV_FP8,
                            .row_bytes = pd_kv_row_bytes(b, rp->kv_dtype, rp->n_kv_heads, rp->head_dim)};
    pd_cuda_rope_kv(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
}

enum { FUSE_MMA_ROPE = 1, FUSE_MMA_RESIDUAL = 2, FUSE_MMA_GLU = 4, FUSE_MMA_OTHER = 8 };

// The fused forms (backend.h): one skinny kernel when it supports the call (rope in its epilogue
// with a bf16 cache and head_dim % 4 == 0); parts it does not do (the PD_CUDA_FUSE_* knobs, or no
// skinny kernel: M > 8, K % 8 != 0) run as the unfused kernels through cb->fuse_ws: rmsnorm into
// scratch, the GEMM into (M, 2N) scratch then silu_mul, rope_kv after; without the skinny kernel
// the residual add is cuBLASLt's accumulate, whose sum is rounded once rather than after the
// branch (within a bf16 ulp).
static void fused_matmul(pd_backend *b, pd_cuda_backend *cb, const pd_matmul_params *p, int lda) {
    const pd_rope_kv_params *rp = p->rope;
    bool nw_ok = !p->norm_w || ((uintptr_t)p->norm_w & 15) == 0;
    // The tensor-core kernel from fuse_mma_min_m rows (no norm prologue: the norm runs apart)
    int form = rp ? FUSE_MMA_ROPE : p->residual ? FUSE_MMA_RESIDUAL : p->glu ? FUSE_MMA_GLU : FUSE_MMA_OTHER;
    bool mma = cb->skinny > 0 && cb->fuse_mma_min_m > 0 && p->M >= cb->fuse_mma_min_m &&
               ((cb->fuse_mma_forms & form) || p->M >= PD_SKINNY_MAX_M) &&
               pd_cuda_skinny_mma_supported(p->M, p->K, lda, p->a, p->w) && !(p->residual && p->out_f32);
    bool skinny = mma || (nw_ok && pd_cuda_skinny_supported(p->M, p->K, lda, p->a, p->w));
    // What the skinny kernel does itself; the rest runs as the unfused kernels around it.
    bool norm_in = skinny && !mma && p->norm_w && p->M <= cb->fuse_norm_max_m;
    // SwiGLU in the batched-decode GEMM's epilogue (after the unfused norm, if any: its output is
    // the aligned scratch, lda K)
    bool bg_glu = !skinny && p->glu && cb->bgemm &&
                  pd_cuda_bgemm_supported(p->M, p->N, p->K, p->norm_w ? p->K : lda, 1, p->out_f32,
                                          p->norm_w ? NULL : p->a, p->w, 0);
    bool glu_in = (skinny && p->glu && cb->fuse_glu) || bg_glu;
    // RoPE + KV write in the batched-decode GEMM's epilogue (head_dim 128, bf16 cache)
    bool bg_rope = !skinny && rp && !p->glu && cb->bgemm && cb->fuse_rope && rp->kv_dtype == PD_KV_ACT &&
                   pd_cuda_bgemm_rope_supported(p->N, rp->n_heads, rp->n_kv_heads, rp->head_dim) &&
                   pd_cuda_bgemm_supported(p->M, p->N, p->K, p->norm_w ? p->K : lda, 0, p->out_f32,
                                           p->norm_w ? NULL : p->a, p->w, 0);
    bool rope_in = (skinny && rp && rp->kv_dtype == PD_KV_ACT && rp->head_dim % (mma ? 16 : 4) == 0 && cb->fuse_rope) ||
                   bg_rope;
    size_t normed = p->norm_w && !norm_in ? (size_t)p->M * (size_t)p->K * 2 : 0;
    size_t gu = p->glu && !glu_in ? (size_t)p->M * 2 * (size_t)p->N * 2 : 0;
    normed = (normed + 255) & ~(size_t)255;
    if (normed + gu) pd_cuda_scratch_reserve(cb, &cb->fuse_ws, &cb->fuse_ws_bytes, normed + gu, true);
    pd_matmul_params q = *p;  // the GEMM left after the unfused parts
    q.norm_w = norm_in ? p->norm_w : NULL, q.glu = glu_in, q.rope = rope_in ? rp : NULL;
    if (p->norm_w && !norm_in) {
        pd_rmsnorm_kparams k = {.x = (void *)p->a, .w = p->norm_w, .out = cb->fuse_ws, .n_rows = p->M, .dim = p->K,
                                .eps = p->norm_eps};
        pd_cuda_rmsnorm(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
        q.a = cb->fuse_ws, q.lda = 0;
    }
    if (p->glu && !glu_in) q.out = (char *)cb->fuse_ws + normed, q.N = 2 * p->N;
    pd_skinny_rope rk = {0};
    if (rope_in)
        rk = (pd_skinny_rope){.positions = rp->positions, .slot_mapping = rp->slot_mapping, .inv_freq = rp->inv_freq,
                              .k_cache = rp->k_cache, .v_cache = rp->v_cache, .n_heads = rp->n_heads,
                              .n_kv_heads = rp->n_kv_heads, .head_dim = rp->head_dim, .attn_scaling = rp->attn_scaling};
    if (mma) {
        pd_skinny_mma_kparams k = {.a = q.a, .w = q.w, .bias = q.bias, .out = q.out, .M = q.M, .N = q.N, .K = q.K,
                                   .lda = q.lda ? q.lda : q.K, .accumulate = q.accumulate, .out_f32 = q.out_f32,
                                   .rows = 16, .pipe = cb->skinny_mma_pipe > 0, .loads = cb->skinny_mma_loads, .glu = q.glu,
                                   .residual = q.residual, .rope = rope_in, .rope_kv = rk};
        pd_cuda_skinny_mma(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
    } else if (skinny) {
        pd_skinny_kparams k = {.a = q.a, .w = q.w, .bias = q.bias, .out = q.out, .M = q.M, .N = q.N, .K = q.K,
                               .lda = q.lda ? q.lda : q.K, .accumulate = q.accumulate, .out_f32 = q.out_f32,
                               .rows = 4, .occ4 = cb->skinny_occ4, .async = cb->skinny_async,
                               .prewait = cb->skinny_prewait, .norm_pf = cb->skinny_norm_pf,
                               .norm_w = q.norm_w, .norm_eps = q.norm_eps, .glu = q.glu,
                               .residual = q.residual, .rope = rope_in, .rope_kv = rk};
        pd_cuda_skinny(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
    } else {
        // cuBLASLt / gemv / bgemm: the residual add as accumulate (the sum rounded once)
        q.accumulate = p->accumulate || p->residual, q.residual = false;
        if (bg_glu || bg_rope) bgemm_run(cb, &q, q.lda ? q.lda : q.K);
        else pd_cuda_gemm_matmul(b, &q);
    }
    if (p->glu && !glu_in) {
        pd_silu_mul_kparams k = {.gu = q.out, .out = p->out, .n_rows = p->M, .F = p->N};
        pd_cuda_silu_mul(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
    }
    if (rp && !rope_in) rope_after(b, cb, rp);
}

void pd_cuda_gemm_matmul(pd_backend *b, const pd_matmul_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    int lda = p->lda ? p->lda : p->K;
    PD_ASSERT(p->M >= 0 && p->N > 0 && p->K > 0 && lda >= p->K);
    if (p->M == 0) return;
    if (p->norm_w || p->glu || p->residual || p->rope) {
        fused_matmul(b, cb, p, lda);
        return;
    }
    if (p->M <= cb->gemv_max_m && pd_cuda_gemv_supported(p->M, p->K, lda)) {
        pd_cuda_scratch_reserve_zeroed(cb, &cb->gemv_ws, &cb->gemv_ws_bytes, pd_cuda_gemv_workspace_bytes(p->N));
        pd_gemv_kparams k = {.a = p->a, .w = p->w, .bias = p->bias, .out = p->out, .M = p->M, .N = p->N,
                             .K = p->K, .lda = lda, .accumulate = p->accumulate, .out_f32 = p->out_f32,
                             .workspace = cb->gemv_ws};
        pd_cuda_gemv(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
        return;
    }
    if (cb->bgemm && pd_cuda_bgemm_supported(p->M, p->N, p->K, lda, 0, p->out_f32, p->a, p->w, 0)) {
        bgemm_run(cb, p, lda);
        return;
    }
    int sk = skinny_choice(cb, p, lda);
    if (sk == SKINNY_MMA || sk == SKINNY_MMA_PIPE) {
        pd_skinny_mma_kparams k = {.a = p->a, .w = p->w, .bias = p->bias, .out = p->out, .M = p->M, .N = p->N,
                                   .K = p->K, .lda = lda, .accumulate = p->accumulate, .out_f32 = p->out_f32,
                                   .rows = cb->skinny_mma_rows, .pipe = sk == SKINNY_MMA_PIPE,
                                   .loads = cb->skinny_mma_loads};
        pd_cuda_skinny_mma(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
        return;
    }
    if (sk == SKINNY_CORES) {
        pd_skinny_kparams k = {.a = p->a, .w = p->w, .bias = p->bias, .out = p->out, .M = p->M, .N = p->N,
                               .K = p->K, .lda = lda, .accumulate = p->accumulate, .out_f32 = p->out_f32,
                               .rows = cb->skinny_rows, .occ4 = cb->skinny_occ4,
                               .async = cb->skinny_async, .prewait = cb->skinny_prewait};
        pd_cuda_skinny(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
        return;
    }
    // f32 output + bias: cuBLASLt has no bf16-bias epilogue for f32 D, so the bias goes after.
    bool bias_after = p->bias && p->out_f32;
    int flags = (p->bias && !bias_after ? PD_GEMM_BIAS : 0) | (p->out_f32 ? PD_GEMM_F32 : 0);
    pd_cuda_gemm_plan *pl = gemm_plan_get(cb, p, lda, flags);
    if (flags & PD_GEMM_BIAS)
        PD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias,
                                                       sizeof p->bias));
    float alpha = 1.0f, beta = p->accumulate ? 1.0f : 0.0f;
    PD_CUBLAS_CHECK(cublasLtMatmul(cb->lt, pl->desc, &alpha, p->w, pl->la, p->a, pl->lb, &beta, p->out, pl->lc,
                                   p->out, pl->lc, &pl->algo, cb->lt_ws, cb->lt_ws_bytes, cb->stream));
    if (bias_after) {
        pd_add_bias_kparams k = {.out = p->out, .bias = p->bias, .M = p->M, .N = p->N};
        pd_cuda_add_bias(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
    }
}
