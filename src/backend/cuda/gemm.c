// gemm.c — pd_op_matmul on CUDA: out (M, N) = a (M, K) . w(N, K)^T [+ bias] [+ out].
//
// Two paths, picked per shape:
//   * M <= gemv_max_m (decode): the skinny tensor-core kernel in kernels/gemv.cu, which streams
//     the weight once (off by default: cuBLASLt measured faster on an H200, see pd_cuda_gemm_init);
//   * otherwise cuBLASLt: bf16 A/B, fp32 compute, bf16 or f32 D, the bias epilogue when bias !=
//     NULL and beta = 1 for accumulate. Row-major out = a.w^T is column-major out^T = w^T.a^T,
//     so cuBLASLt sees A = w (K x N, ld K, transposed), B = a (K x M, ld lda), D = out (N x M, ld N).
// The descriptors and the heuristic's algorithm are cached per (M, N, K, lda, flags): building
// them costs tens of microseconds, a lookup is a short linear scan (a model has ~10 shapes).
#include <stdlib.h>

#include "backend/cuda/cuda_impl.h"
#include "kernels/add_bias.cuh"
#include "kernels/gemv.cuh"

#define PD_CUDA_LT_WS_BYTES (32u << 20)

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
    // Measured on an H200 (tools/gpu/op_bench): cuBLASLt reached 2.4-4.2 TB/s on the Llama-3-8B
    // decode shapes at M = 1..16, the skinny kernel 2.0-4.0 TB/s, so cuBLASLt is the default and
    // the kernel stays selectable (PD_CUDA_GEMV_MAX_M=16) for cards or shapes where it wins.
    cb->gemv_max_m = 0;
    const char *e = getenv("PD_CUDA_GEMV_MAX_M");  // tuning knob for measurements
    if (e && *e) cb->gemv_max_m = atoi(e);
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

static pd_cuda_gemm_plan *gemm_plan_build(pd_cuda_backend *cb, int M, int N, int K, int lda, int flags) {
    if (cb->n_plans == cb->cap_plans) {
        int cap = cb->cap_plans ? cb->cap_plans * 2 : 16;
        pd_cuda_gemm_plan *np = pd_realloc(cb->plans, sizeof *np * (size_t)cap);
        PD_ASSERT(np);
        cb->plans = np;
        cb->cap_plans = cap;
    }
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
    cublasLtMatmulHeuristicResult_t res;
    int n_res = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cb->lt, pl->desc, pl->la, pl->lb, pl->lc, pl->lc, pref, 1,
                                                       &res, &n_res);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || n_res == 0) {
        PD_LOG_E("cuBLASLt: no algorithm for M=%d N=%d K=%d lda=%d flags=%d (status %d)", M, N, K, lda, flags, (int)st);
        pd_abort(__FILE__, __LINE__, __func__, "cuBLASLt heuristic found no algorithm");
    }
    pl->algo = res.algo;
    cb->n_plans++;
    return pl;
}

static pd_cuda_gemm_plan *gemm_plan_get(pd_cuda_backend *cb, int M, int N, int K, int lda, int flags) {
    for (int i = 0; i < cb->n_plans; i++) {
        pd_cuda_gemm_plan *pl = &cb->plans[i];
        if (pl->M == M && pl->N == N && pl->K == K && pl->lda == lda && pl->flags == flags) return pl;
    }
    return gemm_plan_build(cb, M, N, K, lda, flags);
}

void pd_cuda_gemm_matmul(pd_backend *b, const pd_matmul_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    int lda = p->lda ? p->lda : p->K;
    PD_ASSERT(p->M >= 0 && p->N > 0 && p->K > 0 && lda >= p->K);
    if (p->M == 0) return;
    if (p->M <= cb->gemv_max_m && pd_cuda_gemv_supported(p->M, p->K, lda)) {
        pd_gemv_kparams k = {.a = p->a, .w = p->w, .bias = p->bias, .out = p->out, .M = p->M, .N = p->N,
                             .K = p->K, .lda = lda, .accumulate = p->accumulate, .out_f32 = p->out_f32};
        pd_cuda_gemv(&k, cb->stream);
        PD_CUDA_CHECK_LAUNCH();
        return;
    }
    // f32 output + bias: cuBLASLt has no bf16-bias epilogue for f32 D, so the bias goes after.
    bool bias_after = p->bias && p->out_f32;
    int flags = (p->bias && !bias_after ? PD_GEMM_BIAS : 0) | (p->out_f32 ? PD_GEMM_F32 : 0);
    pd_cuda_gemm_plan *pl = gemm_plan_get(cb, p->M, p->N, p->K, lda, flags);
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
