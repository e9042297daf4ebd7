// test_backend_ops — every op of the CUDA backend against the CPU reference backend (fp32), in
// the spirit of ggml's test-backend-ops and FlashInfer's sweeps: odd batch sizes (1, 17), odd kv
// lengths (1, 54, 97, 2047), block sizes 1..32, GQA ratios 1/4/8, head_dim 32/64/128, mixed
// prefill+decode batches with cached prefix blocks.
//
// Inputs are drawn in fp32, rounded to bf16 once, and the *same* rounded values go to both
// backends, so the difference measures only the CUDA backend's arithmetic (bf16 storage of
// outputs and intermediates, fp32 accumulation). Judged by NMSE = sum((x - ref)^2) / sum(ref^2)
// with per-op limits for bf16; outputs are poisoned with NaN before each run, so an unwritten
// element fails. Without a GPU (CI) the CUDA tests are skipped (PD_SKIP: the binary exits 77,
// counted as skipped); the CPU-only checks of the paged layout always run.
#include <math.h>
#include <stdlib.h>

#include <unistd.h>

#include "backend/backend.h"
#include "base/checksum.h"
#include "test.h"

// ---- helpers -----------------------------------------------------------------------------------

#define MAX_BUFS 64
typedef struct ctx {
    pd_backend *cpu, *gpu;
    pd_buffer *bufs[MAX_BUFS];
    int n_bufs;
    pd_rng rng;
} ctx;

static bool ctx_init(ctx *c, uint64_t seed) {
    memset(c, 0, sizeof *c);
    pd_rng_seed(&c->rng, seed);
    if (!pd_backend_has_cuda()) return false;
    pd_err err = {0};
    c->cpu = pd_backend_cpu_new(0);
    c->gpu = pd_backend_new("cuda", 0, &err);
    if (!c->gpu) {
        printf("  cuda backend: %s\n", err.msg);
        pd_backend_free(c->cpu);
        c->cpu = NULL;
    }
    return c->gpu != NULL;
}

static void ctx_release(ctx *c) {  // frees the buffers, keeps the backends
    for (int i = 0; i < c->n_bufs; i++) pd_buffer_free(c->bufs[i]);
    c->n_bufs = 0;
}

static void ctx_fini(ctx *c) {
    ctx_release(c);
    pd_backend_free(c->gpu);
    pd_backend_free(c->cpu);
}


static float *rand_f32(ctx *c, size_t n, float scale) {
    float *h = pd_malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) h[i] = pd_bf16_to_f32(pd_f32_to_bf16(scale * pd_rng_normal(&c->rng)));
    return h;
}

// Device buffer on backend b holding host f32 data converted to `dt` (F32 or BF16).
static void *dev_from_f32(ctx *c, pd_backend *b, const float *h, size_t n, pd_dtype dt) {
    size_t es = pd_dtype_size(dt);
    pd_buffer *buf = pd_buffer_alloc(b, n * es);
    PD_ASSERT(buf && c->n_bufs < MAX_BUFS);
    c->bufs[c->n_bufs++] = buf;
    if (dt == PD_DTYPE_BF16) {
        uint16_t *t = pd_malloc(2 * (n ? n : 1));
        for (size_t i = 0; i < n; i++) t[i] = pd_f32_to_bf16(h[i]);
        pd_backend_upload(b, pd_buffer_ptr(buf), t, n * 2);
        pd_backend_sync(b);
        pd_free(t);
    } else {
        pd_backend_upload(b, pd_buffer_ptr(buf), h, n * es);
        pd_backend_sync(b);
    }
    return pd_buffer_ptr(buf);
}

static void *dev_act(ctx *c, pd_backend *b, const float *h, size_t n) {
    return dev_from_f32(c, b, h, n, pd_backend_act_dtype(b));
}

static int32_t *dev_i32(ctx *c, pd_backend *b, const int32_t *h, size_t n) {
    pd_buffer *buf = pd_buffer_alloc(b, 4 * (n ? n : 1));
    PD_ASSERT(buf && c->n_bufs < MAX_BUFS);
    c->bufs[c->n_bufs++] = buf;
    pd_backend_upload(b, pd_buffer_ptr(buf), h, 4 * n);
    pd_backend_sync(b);
    return pd_buffer_ptr(buf);
}

// Output buffer poisoned with NaN (0xff bytes are NaN in f32 and bf16).
static void *dev_out(ctx *c, pd_backend *b, size_t n, pd_dtype dt) {
    pd_buffer *buf = pd_buffer_alloc(b, n * pd_dtype_size(dt));
    PD_ASSERT(buf && c->n_bufs < MAX_BUFS);
    c->bufs[c->n_bufs++] = buf;
    pd_backend_memset(b, pd_buffer_ptr(buf), 0xff, n * pd_dtype_size(dt));
    return pd_buffer_ptr(buf);
}

static float *to_host(pd_backend *b, const void *d, size_t n, pd_dtype dt) {
    float *h = pd_malloc(sizeof(float) * (n ? n : 1));
    if (dt == PD_DTYPE_BF16) {
        uint16_t *t = pd_malloc(2 * (n ? n : 1));
        pd_backend_download(b, t, d, 2 * n);
        for (size_t i = 0; i < n; i++) h[i] = pd_bf16_to_f32(t[i]);
        pd_free(t);
    } else {
        pd_backend_download(b, h, d, 4 * n);
    }
    return h;
}

static double nmse(const float *x, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return INFINITY;
        double d = (double)x[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? num / den : num;
}

// Compares the GPU output (act dtype unless f32) with the CPU one; returns the NMSE.
static double compare(ctx *c, const void *g, const void *r, size_t n, bool f32, double limit, const char *what) {
    float *hg = to_host(c->gpu, g, n, f32 ? PD_DTYPE_F32 : pd_backend_act_dtype(c->gpu));
    float *hr = to_host(c->cpu, r, n, PD_DTYPE_F32);
    double e = nmse(hg, hr, n);
    PD_CHECK_MSG(e <= limit, "%s: nmse %.3g > %.3g", what, e, limit);
    pd_free(hg);
    pd_free(hr);
    return e;
}

#define NMSE_ELEM 1e-5   // elementwise ops: one bf16 rounding of the output
#define NMSE_ELEM_HF 3e-5  // rmsnorm, silu_mul, rope: also an intermediate rounded, as transformers does
#define NMSE_GEMM 5e-5   // fp32 accumulate, bf16 out
#define NMSE_ATTN 2e-4   // P rounded to bf16 before P.V

// ---- elementwise ops ---------------------------------------------------------------------------

PD_TEST(test_cuda_embed_get_rows) {
    ctx c;
    if (!ctx_init(&c, 1)) PD_SKIP("%s: no CUDA device", __func__);
    int dims[] = {64, 20, 4096}, ns[] = {1, 17};
    for (size_t di = 0; di < PD_ARRAY_LEN(dims); di++)
        for (size_t ni = 0; ni < PD_ARRAY_LEN(ns); ni++) {
            int dim = dims[di], n = ns[ni], vocab = 300;
            float *table = rand_f32(&c, (size_t)vocab * dim, 1.0f);
            int32_t ids[17];
            for (int i = 0; i < n; i++) ids[i] = (int32_t)(pd_rng_next(&c.rng) % vocab);
            pd_backend *bs[2] = {c.cpu, c.gpu};
            void *out[2], *rows[2];
            for (int k = 0; k < 2; k++) {
                pd_embed_params p = {.ids = dev_i32(&c, bs[k], ids, n), .table = dev_from_f32(&c, bs[k], table,
                                     (size_t)vocab * dim, pd_backend_weight_dtype(bs[k])),
                                     .out = out[k] = dev_out(&c, bs[k], (size_t)n * dim, pd_backend_act_dtype(bs[k])),
                                     .n_tokens = n, .dim = dim, .vocab = vocab};
                pd_op_embed(bs[k], &p);
                int32_t idx[3] = {n - 1, 0, n / 2};
                pd_get_rows_params g = {.x = out[k], .idx = dev_i32(&c, bs[k], idx, 3),
                                        .out = rows[k] = dev_out(&c, bs[k], 3 * (size_t)dim, pd_backend_act_dtype(bs[k])),
                                        .n_rows = 3, .dim = dim};
                pd_op_get_rows(bs[k], &g);
            }
            // embed of bf16-exact values is exact
            compare(&c, out[1], out[0], (size_t)n * dim, false, 0.0, "embed");
            compare(&c, rows[1], rows[0], 3 * (size_t)dim, false, 0.0, "get_rows");
            pd_free(table);
            ctx_release(&c);
        }
    ctx_fini(&c);
}

PD_TEST(test_cuda_rmsnorm) {
    ctx c;
    if (!ctx_init(&c, 2)) PD_SKIP("%s: no CUDA device", __func__);
    int dims[] = {128, 4096, 100, 8192}, ns[] = {1, 17};
    for (size_t di = 0; di < PD_ARRAY_LEN(dims); di++)
        for (size_t ni = 0; ni < PD_ARRAY_LEN(ns); ni++)
            for (int with_add = 0; with_add < 2; with_add++) {
                int dim = dims[di], n = ns[ni];
                size_t sz = (size_t)n * dim;
                float *x = rand_f32(&c, sz, 2.0f), *a = rand_f32(&c, sz, 1.0f), *w = rand_f32(&c, dim, 1.0f);
                pd_backend *bs[2] = {c.cpu, c.gpu};
                void *out[2], *xd[2];
                for (int k = 0; k < 2; k++) {
                    pd_rmsnorm_params p = {.x = xd[k] = dev_act(&c, bs[k], x, sz),
                                           .add = with_add ? dev_act(&c, bs[k], a, sz) : NULL,
                                           .w = dev_from_f32(&c, bs[k], w, dim, pd_backend_weight_dtype(bs[k])),
                                           .out = out[k] = dev_out(&c, bs[k], sz, pd_backend_act_dtype(bs[k])),
                                           .n_rows = n, .dim = dim, .eps = 1e-5f};
                    pd_op_rmsnorm(bs[k], &p);
                }
                char what[64];
                snprintf(what, sizeof what, "rmsnorm dim=%d n=%d add=%d", dim, n, with_add);
                compare(&c, out[1], out[0], sz, false, NMSE_ELEM_HF, what);
                if (with_add) compare(&c, xd[1], xd[0], sz, false, NMSE_ELEM, "rmsnorm residual");
                pd_free(x);
                pd_free(a);
                pd_free(w);
                ctx_release(&c);
            }
    ctx_fini(&c);
}

PD_TEST(test_cuda_silu_mul) {
    ctx c;
    if (!ctx_init(&c, 3)) PD_SKIP("%s: no CUDA device", __func__);
    int Fs[] = {64, 100, 1376}, ns[] = {1, 17};
    for (size_t fi = 0; fi < PD_ARRAY_LEN(Fs); fi++)
        for (size_t ni = 0; ni < PD_ARRAY_LEN(ns); ni++) {
            int F = Fs[fi], n = ns[ni];
            float *gu = rand_f32(&c, (size_t)n * 2 * F, 2.0f);
            pd_backend *bs[2] = {c.cpu, c.gpu};
            void *out[2];
            for (int k = 0; k < 2; k++) {
                pd_silu_mul_params p = {.gu = dev_act(&c, bs[k], gu, (size_t)n * 2 * F),
                                        .out = out[k] = dev_out(&c, bs[k], (size_t)n * F, pd_backend_act_dtype(bs[k])),
                                        .n_rows = n, .F = F};
                pd_op_silu_mul(bs[k], &p);
            }
            compare(&c, out[1], out[0], (size_t)n * F, false, NMSE_ELEM_HF, "silu_mul");
            pd_free(gu);
            ctx_release(&c);
        }
    ctx_fini(&c);
}

PD_TEST(test_cuda_fill_normal) {
    ctx c;
    if (!ctx_init(&c, 4)) PD_SKIP("%s: no CUDA device", __func__);
    size_t n = 1 << 20;
    for (int f32 = 0; f32 < 2; f32++) {
        pd_dtype dt = f32 ? PD_DTYPE_F32 : PD_DTYPE_BF16;
        void *a = dev_out(&c, c.gpu, n, dt), *b = dev_out(&c, c.gpu, n, dt), *d = dev_out(&c, c.gpu, n, dt);
        pd_op_fill_normal(c.gpu, a, dt, n, 42, 0.5f, 2.0f);
        pd_op_fill_normal(c.gpu, b, dt, n, 42, 0.5f, 2.0f);
        pd_op_fill_normal(c.gpu, d, dt, n, 43, 0.5f, 2.0f);
        float *ha = to_host(c.gpu, a, n, dt), *hb = to_host(c.gpu, b, n, dt), *hd = to_host(c.gpu, d, n, dt);
        double s = 0, ss = 0;
        size_t n_same_seed_diff = 0, n_other_seed_same = 0;
        for (size_t i = 0; i < n; i++) {
            PD_REQUIRE(isfinite(ha[i]));
            s += ha[i];
            ss += (double)ha[i] * ha[i];
            n_same_seed_diff += ha[i] != hb[i];
            n_other_seed_same += ha[i] == hd[i];
        }
        double mean = s / n, sd = sqrt(ss / n - mean * mean);
        PD_CHECK_NEAR(mean, 0.5, 0.01);
        PD_CHECK_NEAR(sd, 2.0, 0.01);
        PD_CHECK_EQ(n_same_seed_diff, 0);
        PD_CHECK(n_other_seed_same < n / 100);
        pd_free(ha);
        pd_free(hb);
        pd_free(hd);
        ctx_release(&c);
    }
    ctx_fini(&c);
}

// ---- matmul ------------------------------------------------------------------------------------

static void matmul_case(ctx *c, pd_backend *gpu, int M, int N, int K, int lda, bool bias, bool acc, bool f32) {
    float *a = rand_f32(c, (size_t)M * lda, 1.0f), *w = rand_f32(c, (size_t)N * K, 0.05f);
    float *bv = rand_f32(c, N, 0.5f), *o0 = rand_f32(c, (size_t)M * N, 1.0f);
    pd_backend *bs[2] = {c->cpu, gpu};
    void *out[2];
    for (int k = 0; k < 2; k++) {
        pd_dtype odt = f32 ? PD_DTYPE_F32 : pd_backend_act_dtype(bs[k]);
        if (acc) out[k] = dev_from_f32(c, bs[k], o0, (size_t)M * N, odt);
        else out[k] = dev_out(c, bs[k], (size_t)M * N, odt);
        pd_matmul_params p = {.a = dev_act(c, bs[k], a, (size_t)M * lda),
                              .w = dev_from_f32(c, bs[k], w, (size_t)N * K, pd_backend_weight_dtype(bs[k])),
                              .bias = bias ? dev_from_f32(c, bs[k], bv, N, pd_backend_weight_dtype(bs[k])) : NULL,
                              .out = out[k], .M = M, .N = N, .K = K, .lda = lda == K ? 0 : lda,
                              .accumulate = acc, .out_f32 = f32};
        pd_op_matmul(bs[k], &p);
    }
    pd_backend_sync(gpu);  // gpu may be a second backend (own stream): compare() reads through c->gpu
    char what[128];
    snprintf(what, sizeof what, "matmul M=%d N=%d K=%d lda=%d bias=%d acc=%d f32=%d", M, N, K, lda, bias, acc, f32);
    compare(c, out[1], out[0], (size_t)M * N, f32, f32 ? 1e-5 : NMSE_GEMM, what);
    pd_free(a);
    pd_free(w);
    pd_free(bv);
    pd_free(o0);
    ctx_release(c);
}

// Two dependent skinny GEMMs back to back with no sync between them (PDL: the second one's weight
// loads start before the first one ends, its activation reads must not), then the same on CPU.
static void matmul_chain_case(ctx *c, int M, int N1, int K, int N2) {
    float *a = rand_f32(c, (size_t)M * K, 1.0f), *w1 = rand_f32(c, (size_t)N1 * K, 0.05f);
    float *w2 = rand_f32(c, (size_t)N2 * N1, 0.05f), *o0 = rand_f32(c, (size_t)M * N2, 1.0f);
    pd_backend *bs[2] = {c->cpu, c->gpu};
    void *out[2];
    for (int k = 0; k < 2; k++) {
        void *h = dev_out(c, bs[k], (size_t)M * N1, pd_backend_act_dtype(bs[k]));
        out[k] = dev_act(c, bs[k], o0, (size_t)M * N2);
        pd_op_matmul(bs[k], &(pd_matmul_params){.a = dev_act(c, bs[k], a, (size_t)M * K),
                                                .w = dev_from_f32(c, bs[k], w1, (size_t)N1 * K, pd_backend_weight_dtype(bs[k])),
                                                .out = h, .M = M, .N = N1, .K = K});
        void *w2d = dev_from_f32(c, bs[k], w2, (size_t)N2 * N1, pd_backend_weight_dtype(bs[k]));
        for (int r = 0; r < 2; r++)  // out += h . w2^T, twice
            pd_op_matmul(bs[k], &(pd_matmul_params){.a = h, .w = w2d, .out = out[k], .M = M, .N = N2, .K = N1,
                                                    .accumulate = true});
    }
    pd_backend_sync(c->gpu);
    char what[96];
    snprintf(what, sizeof what, "matmul chain M=%d N1=%d K=%d N2=%d", M, N1, K, N2);
    compare(c, out[1], out[0], (size_t)M * N2, false, NMSE_GEMM, what);
    pd_free(a), pd_free(w1), pd_free(w2), pd_free(o0);
    ctx_release(c);
}

PD_TEST(test_cuda_matmul) {
    ctx c;
    if (!ctx_init(&c, 5)) PD_SKIP("%s: no CUDA device", __func__);
    // Both GEMM paths: c.gpu uses the skinny decode kernel for M <= 16, a second backend cuBLASLt
    // for every M (whichever the default is).
    // (the row-streaming skinny kernel off in both: test_cuda_skinny covers it)
    // (the batched-decode GEMM off in lt_only: test_cuda_bgemm covers it)
    setenv("PD_CUDA_GEMV_MAX_M", "0", 1);
    setenv("PD_CUDA_SKINNY", "0", 1);
    setenv("PD_CUDA_BGEMM", "0", 1);
    pd_err err = {0};
    pd_backend *lt_only = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_BGEMM");
    setenv("PD_CUDA_GEMV_MAX_M", "16", 1);
    pd_backend *gemv_on = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_GEMV_MAX_M");
    unsetenv("PD_CUDA_SKINNY");
    PD_REQUIRE(lt_only && gemv_on);
    pd_backend *dflt = c.gpu;
    c.gpu = gemv_on;  // compare() reads through c.gpu: the backend under test
    int Ms[] = {1, 3, 16, 17, 64, 300}, NKs[][2] = {{8, 64}, {1000, 136}, {512, 1024}, {96, 4096}};
    for (size_t mi = 0; mi < PD_ARRAY_LEN(Ms); mi++)
        for (size_t nk = 0; nk < PD_ARRAY_LEN(NKs); nk++)
            for (int flags = 0; flags < 8; flags++) {
                int M = Ms[mi], N = NKs[nk][0], K = NKs[nk][1];
                bool bias = flags & 1, acc = flags & 2, f32 = flags & 4;
                matmul_case(&c, c.gpu, M, N, K, K, bias, acc, f32);
                if (M <= 17 && flags % 3 != 1) matmul_case(&c, lt_only, M, N, K, K, bias, acc, f32);
            }
    matmul_case(&c, c.gpu, 5, 256, 128, 384, true, false, false);   // lda > K (a slice of qkv)
    matmul_case(&c, c.gpu, 40, 256, 128, 384, false, true, false);
    // Decode-sized shapes: every SM busy, tiles split over several warps (stream-K partials).
    int big_ms[] = {1, 8, 9, 16};
    for (size_t mi = 0; mi < PD_ARRAY_LEN(big_ms); mi++) {
        matmul_case(&c, c.gpu, big_ms[mi], 2048, 4096, 4096, mi & 1, mi >= 2, false);
        matmul_case(&c, c.gpu, big_ms[mi], 1000, 2048, 2056, true, false, mi & 1);
    }
    matmul_chain_case(&c, 1, 2048, 1024, 512);
    matmul_chain_case(&c, 7, 512, 4096, 2048);
    matmul_chain_case(&c, 16, 4096, 4096, 96);
    c.gpu = dflt;
    pd_backend_free(lt_only);
    pd_backend_free(gemv_on);
    ctx_fini(&c);
}

// Backends with the given PD_CUDA_SKINNY* variables set (NULL: unset) for their creation.
typedef struct skinny_var { const char *skinny, *mma, *rows, *mma_rows, *pipe; } skinny_var;
static pd_backend *skinny_backend(const skinny_var *v) {
    const char *names[] = {"PD_CUDA_SKINNY", "PD_CUDA_SKINNY_MMA", "PD_CUDA_SKINNY_ROWS", "PD_CUDA_SKINNY_MMA_ROWS",
                           "PD_CUDA_SKINNY_MMA_PIPE"};
    const char *vals[] = {v->skinny, v->mma, v->rows, v->mma_rows, v->pipe};
    for (int i = 0; i < 5; i++)
        if (vals[i]) setenv(names[i], vals[i], 1);
    pd_err err = {0};
    pd_backend *b = pd_backend_new("cuda", 0, &err);
    for (int i = 0; i < 5; i++) unsetenv(names[i]);
    return b;
}

// Random shapes (K % 8 == 0, N from 1, row strides > K, every flag) at M = ms[0..n_ms-1], `per_m`
// cases each.
static void skinny_random_cases(ctx *c, const int *ms, int n_ms, int per_m) {
    for (int mi = 0; mi < n_ms; mi++)
        for (int i = 0; i < per_m; i++) {
            int N = 1 + (int)(pd_rng_next(&c->rng) % (i % 2 == 0 ? 40 : 1500));
            int K = 8 * (1 + (int)(pd_rng_next(&c->rng) % (i % 2 == 0 ? 40 : 700)));
            int lda = K + (i % 3 == 2 ? 8 * (1 + (int)(pd_rng_next(&c->rng) % 4)) : 0);
            int flags = (int)(pd_rng_next(&c->rng) % 8);
            matmul_case(c, c->gpu, ms[mi], N, K, lda, flags & 1, flags & 2, flags & 4);
        }
}

// The row-streaming CUDA-core skinny kernel (PD_CUDA_SKINNY=2: every supported call, whatever the
// per-shape rule picks; PD_CUDA_SKINNY_MMA=0: never the tensor-core kernel) against the CPU
// reference: M = 1..8 over random shapes, decode-sized shapes with K-chunk tails, and a PDL chain,
// with 4 and 2 weight rows per block.
PD_TEST(test_cuda_skinny) {
    ctx c;
    if (!ctx_init(&c, 17)) PD_SKIP("%s: no CUDA device", __func__);
    skinny_var var[] = {{"2", "0", NULL, NULL, NULL}, {"2", "0", "2", NULL, NULL}};
    pd_backend *bs[2];
    for (int v = 0; v < 2; v++) PD_REQUIRE((bs[v] = skinny_backend(&var[v])) != NULL);
    pd_backend *dflt = c.gpu;
    int ms[] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int v = 0; v < 2; v++) {
        c.gpu = bs[v];  // compare() reads through c.gpu
        skinny_random_cases(&c, ms, 8, 6);
        int big[][2] = {{4096, 4096}, {1027, 14336}, {6144, 4104}};
        for (int M = 1; M <= 8; M += v ? 7 : 3)
            for (int s = 0; s < 3; s++) matmul_case(&c, c.gpu, M, big[s][0], big[s][1], big[s][1], s == 1, s == 2, M == 4);
        matmul_chain_case(&c, 1, 2048, 1024, 512);
        matmul_chain_case(&c, 8, 4096, 4096, 96);
    }
    c.gpu = dflt;
    for (int v = 0; v < 2; v++) pd_backend_free(bs[v]);
    ctx_fini(&c);
}

// The tensor-core skinny kernel (PD_CUDA_SKINNY_MMA=2) against the CPU reference at M = 1..16:
// 16 rows per block single-buffered over every M, then 32 rows and double-buffered loads
// (PD_CUDA_SKINNY_MMA_ROWS=32, PD_CUDA_SKINNY_MMA_PIPE=1) at the n-tile edges (M = 1, 8, 9, 16);
// random shapes, decode-sized shapes with K-chunk tails and N not a multiple of the block's rows,
// PDL chains. Then the two measured rules (PD_CUDA_SKINNY=1 with PD_CUDA_SKINNY_MMA=3 and the
// default 1) on shapes that take each of their branches (CUDA cores, tensor cores with and without
// double buffering, cuBLASLt).
PD_TEST(test_cuda_skinny_mma) {
    ctx c;
    if (!ctx_init(&c, 23)) PD_SKIP("%s: no CUDA device", __func__);
    skinny_var var[] = {{"2", "2", NULL, NULL, "0"}, {"2", "2", NULL, "32", "0"}, {"2", "2", NULL, NULL, "1"},
                        {"2", "2", NULL, "32", "1"}, {"1", "3", NULL, NULL, NULL}, {"1", NULL, NULL, NULL, NULL}};
    enum { NV = PD_ARRAY_LEN(var) };
    pd_backend *bs[NV];
    for (int v = 0; v < NV; v++) PD_REQUIRE((bs[v] = skinny_backend(&var[v])) != NULL);
    pd_backend *dflt = c.gpu;
    int all[16], edges[] = {1, 8, 9, 16};
    for (int i = 0; i < 16; i++) all[i] = i + 1;
    for (int v = 0; v < NV - 2; v++) {
        c.gpu = bs[v];  // compare() reads through c.gpu
        if (v == 0) skinny_random_cases(&c, all, 16, 3);
        else skinny_random_cases(&c, edges, 4, 2);
        if (v == 0) {
            matmul_case(&c, c.gpu, 5, 4096, 4096, 4096, false, false, false);
            matmul_case(&c, c.gpu, 5, 1027, 14336, 14336, true, false, false);
            matmul_case(&c, c.gpu, 16, 6144, 4104, 4104, false, true, false);
            matmul_case(&c, c.gpu, 16, 4104, 4096, 4096, false, false, true);
            matmul_chain_case(&c, 1, 2048, 1024, 512);
            matmul_chain_case(&c, 9, 1024, 2048, 4096);
        }
        matmul_case(&c, c.gpu, 9, 1027, 14336, 14336, v & 1, true, false);
        matmul_case(&c, c.gpu, 12, 4104, 4096, 4096, true, false, true);
        matmul_chain_case(&c, 16, 4096, 4096, 96);
    }
    int rule[][3] = {{4, 2048, 10240}, {5, 4096, 4096}, {6, 4096, 4096}, {7, 10240, 2048},
                     {8, 10240, 2048}, {9, 2048, 10240}, {16, 4104, 2048}};
    for (int v = NV - 2; v < NV; v++) {
        c.gpu = bs[v];
        for (size_t i = 0; i < PD_ARRAY_LEN(rule); i++)
            matmul_case(&c, c.gpu, rule[i][0], rule[i][1], rule[i][2], rule[i][2], i & 1, i & 2, i == 3);
        matmul_chain_case(&c, 6, 4096, 4096, 2048);
    }
    c.gpu = dflt;
    for (int v = 0; v < NV; v++) pd_backend_free(bs[v]);
    ctx_fini(&c);
}

// ---- fused matmul forms (backend.h "Fused forms": norm_w, glu, residual) --------------------------

enum { FZ_NORM = 1, FZ_GLU = 2, FZ_RES = 4, FZ_BIAS = 8, FZ_F32 = 16 };

// The backend the unfused GPU sequence of fused_case runs on: PD_CUDA_SKINNY=2, so that where the
// fused form is one skinny kernel its unfused sequence uses the same GEMM kernel (cuBLASLt sums in
// another order and rounds its bias epilogue differently: NMSE up to 2.6e-5 against the fused
// kernel on an H100, session 9).
static pd_backend *g_unfused;

// One fused call on the CPU reference and on gpu; on the GPU also the unfused op sequence it
// stands for (rmsnorm, matmul into (M, 2N), silu_mul, rmsnorm's residual add), which the fused
// skinny kernel must match up to the norm's summation order (NMSE_ELEM; where the call falls back
// to cuBLASLt, whose residual add rounds the sum once, NMSE_ELEM_HF).
static void fused_case(ctx *c, pd_backend *gpu, int M, int N, int K, int flags) {
    bool norm = flags & FZ_NORM, glu = flags & FZ_GLU, res = flags & FZ_RES, bias = flags & FZ_BIAS, f32 = flags & FZ_F32;
    int Nw = glu ? 2 * N : N;
    float *a = rand_f32(c, (size_t)M * K, norm ? 3.0f : 1.0f), *g = rand_f32(c, K, 1.0f);
    float *w = rand_f32(c, (size_t)Nw * K, 0.05f), *bv = rand_f32(c, Nw, 0.5f), *o0 = rand_f32(c, (size_t)M * N, 1.0f);
    pd_backend *bs[2] = {c->cpu, gpu};
    void *out[2];
    for (int k = 0; k < 2; k++) {
        pd_dtype odt = f32 ? PD_DTYPE_F32 : pd_backend_act_dtype(bs[k]);
        out[k] = res ? dev_from_f32(c, bs[k], o0, (size_t)M * N, odt) : dev_out(c, bs[k], (size_t)M * N, odt);
        pd_op_matmul(bs[k], &(pd_matmul_params){.a = dev_act(c, bs[k], a, (size_t)M * K),
                                                .w = dev_from_f32(c, bs[k], w, (size_t)Nw * K, pd_backend_weight_dtype(bs[k])),
                                                .bias = bias ? dev_from_f32(c, bs[k], bv, Nw, pd_backend_weight_dtype(bs[k])) : NULL,
                                                .out = out[k], .M = M, .N = N, .K = K, .out_f32 = f32,
                                                .norm_w = norm ? dev_from_f32(c, bs[k], g, K, pd_backend_weight_dtype(bs[k])) : NULL,
                                                .norm_eps = 1e-5f, .glu = glu, .residual = res});
    }
    // The unfused sequence on the GPU.
    pd_backend *keep = c->gpu;
    pd_backend_sync(gpu);
    gpu = g_unfused ? g_unfused : gpu;
    bool on_skinny = M <= 8 && K % 8 == 0;
    pd_dtype adt = pd_backend_act_dtype(gpu), wdt = pd_backend_weight_dtype(gpu);
    void *ad = dev_act(c, gpu, a, (size_t)M * K), *wd = dev_from_f32(c, gpu, w, (size_t)Nw * K, wdt);
    void *bd = bias ? dev_from_f32(c, gpu, bv, Nw, wdt) : NULL, *xin = ad;
    if (norm) {
        xin = dev_out(c, gpu, (size_t)M * K, adt);
        pd_op_rmsnorm(gpu, &(pd_rmsnorm_params){.x = ad, .w = dev_from_f32(c, gpu, g, K, wdt), .out = xin, .n_rows = M,
                                                .dim = K, .eps = 1e-5f});
    }
    void *ref = res ? dev_from_f32(c, gpu, o0, (size_t)M * N, adt) : dev_out(c, gpu, (size_t)M * N, f32 ? PD_DTYPE_F32 : adt);
    void *mm = glu || res ? dev_out(c, gpu, (size_t)M * Nw, adt) : ref;
    pd_op_matmul(gpu, &(pd_matmul_params){.a = xin, .w = wd, .bias = bd, .out = mm, .M = M, .N = Nw, .K = K, .out_f32 = f32});
    if (glu) pd_op_silu_mul(gpu, &(pd_silu_mul_params){.gu = mm, .out = ref, .n_rows = M, .F = N});
    if (res) {  // ref += mm, rounded as rmsnorm's residual add (its normalised output is not used)
        void *junk = dev_out(c, gpu, (size_t)M * N, adt);
        float *ones = pd_malloc(sizeof(float) * (size_t)N);
        for (int i = 0; i < N; i++) ones[i] = 1.0f;
        pd_op_rmsnorm(gpu, &(pd_rmsnorm_params){.x = ref, .add = mm, .w = dev_from_f32(c, gpu, ones, N, wdt), .out = junk,
                                                .n_rows = M, .dim = N, .eps = 1e-5f});
        pd_free(ones);
    }
    pd_backend_sync(gpu);
    char what[128];
    snprintf(what, sizeof what, "fused M=%d N=%d K=%d norm=%d glu=%d res=%d bias=%d f32=%d", M, N, K, norm, glu, res,
             bias, f32);
    c->gpu = gpu;  // compare() reads through c->gpu
    compare(c, out[1], out[0], (size_t)M * N, f32, f32 ? 1e-5 : glu ? 2 * NMSE_GEMM : NMSE_GEMM, what);
    float *hf = to_host(gpu, out[1], (size_t)M * N, f32 ? PD_DTYPE_F32 : adt);
    float *hu = to_host(gpu, ref, (size_t)M * N, f32 ? PD_DTYPE_F32 : adt);
    double e = nmse(hf, hu, (size_t)M * N);
    PD_CHECK_MSG(e <= (on_skinny ? NMSE_ELEM : NMSE_ELEM_HF), "%s vs the unfused ops: nmse %.3g", what, e);
    c->gpu = keep;
    pd_free(hf), pd_free(hu);
    pd_free(a), pd_free(g), pd_free(w), pd_free(bv), pd_free(o0);
    ctx_release(c);
}

// The decode layer's fused tail with no sync between the kernels (PDL: each one's weight loads
// start before its predecessor ends; its reads of x must not): x += o(attn); mlp = glu(norm(x));
// x += down(mlp); logits = head(norm(x)), against the CPU.
static void fused_chain_case(ctx *c, int M, int D, int F, int V) {
    float *x0 = rand_f32(c, (size_t)M * D, 1.0f), *attn = rand_f32(c, (size_t)M * D, 1.0f);
    float *wo = rand_f32(c, (size_t)D * D, 0.03f), *wgu = rand_f32(c, (size_t)2 * F * D, 0.03f);
    float *wd = rand_f32(c, (size_t)D * F, 0.03f), *wh = rand_f32(c, (size_t)V * D, 0.03f);
    float *g1 = rand_f32(c, D, 1.0f), *g2 = rand_f32(c, D, 1.0f);
    pd_backend *bs[2] = {c->cpu, c->gpu};
    void *x[2], *lg[2];
    for (int k = 0; k < 2; k++) {
        pd_backend *b = bs[k];
        pd_dtype wdt = pd_backend_weight_dtype(b);
        x[k] = dev_act(c, b, x0, (size_t)M * D);
        void *mlp = dev_out(c, b, (size_t)M * F, pd_backend_act_dtype(b));
        lg[k] = dev_out(c, b, (size_t)M * V, PD_DTYPE_F32);
        pd_op_matmul(b, &(pd_matmul_params){.a = dev_act(c, b, attn, (size_t)M * D), .w = dev_from_f32(c, b, wo, (size_t)D * D, wdt),
                                            .out = x[k], .M = M, .N = D, .K = D, .residual = true});
        pd_op_matmul(b, &(pd_matmul_params){.a = x[k], .w = dev_from_f32(c, b, wgu, (size_t)2 * F * D, wdt), .out = mlp,
                                            .M = M, .N = F, .K = D, .norm_w = dev_from_f32(c, b, g1, D, wdt),
                                            .norm_eps = 1e-5f, .glu = true});
        pd_op_matmul(b, &(pd_matmul_params){.a = mlp, .w = dev_from_f32(c, b, wd, (size_t)D * F, wdt), .out = x[k], .M = M,
                                            .N = D, .K = F, .residual = true});
        pd_op_matmul(b, &(pd_matmul_params){.a = x[k], .w = dev_from_f32(c, b, wh, (size_t)V * D, wdt), .out = lg[k],
                                            .M = M, .N = V, .K = D, .out_f32 = true,
                                            .norm_w = dev_from_f32(c, b, g2, D, wdt), .norm_eps = 1e-5f});
    }
    pd_backend_sync(c->gpu);
    char what[96];
    snprintf(what, sizeof what, "fused chain M=%d D=%d F=%d V=%d", M, D, F, V);
    compare(c, x[1], x[0], (size_t)M * D, false, NMSE_GEMM, what);
    compare(c, lg[1], lg[0], (size_t)M * V, true, 2 * NMSE_GEMM, what);
    pd_free(x0), pd_free(attn), pd_free(wo), pd_free(wgu), pd_free(wd), pd_free(wh), pd_free(g1), pd_free(g2);
    ctx_release(c);
}

static const int FUSED_FORMS[] = {FZ_NORM, FZ_NORM | FZ_F32, FZ_NORM | FZ_GLU, FZ_GLU, FZ_RES, FZ_NORM | FZ_RES};

// Every fused form, M = 1..8 (the skinny kernel) and 9, 17 (the unfused fallback), random shapes
// (odd N, K % 8 == 0; test_cuda_fused_odd_k has the rest), bias on and off; decode-sized shapes;
// the layer chain.
// The unfused reference: the CUDA-core skinny kernel on every call it supports (M <= 8) and
// cuBLASLt above, as the fused forms' own fallback (PD_CUDA_SKINNY_MMA=0: no tensor-core kernel).
static pd_backend *skinny_cores_backend(void) {
    pd_backend *b = skinny_backend(&(skinny_var){.skinny = "2", .mma = "0"});
    PD_ASSERT(b);
    return b;
}

PD_TEST(test_cuda_matmul_fused) {
    ctx c;
    if (!ctx_init(&c, 18)) PD_SKIP("%s: no CUDA device", __func__);
    g_unfused = skinny_cores_backend();
    int Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17};
    for (size_t mi = 0; mi < PD_ARRAY_LEN(Ms); mi++)
        for (size_t f = 0; f < PD_ARRAY_LEN(FUSED_FORMS); f++)
            for (int i = 0; i < 2; i++) {
                int M = Ms[mi], N = 1 + (int)(pd_rng_next(&c.rng) % 300);
                int K = 8 * (1 + (int)(pd_rng_next(&c.rng) % (i ? 500 : 20)));
                fused_case(&c, c.gpu, M, N, K, FUSED_FORMS[f] | (((int)f + i + M) % 2 ? FZ_BIAS : 0));
            }
    int dec[][3] = {{6144, 4096, FZ_NORM | FZ_BIAS}, {4096, 4096, FZ_RES}, {3584, 4096, FZ_NORM | FZ_GLU},
                    {2048, 14336, FZ_RES | FZ_BIAS}, {9000, 4096, FZ_NORM | FZ_F32}};
    for (int M = 1; M <= 8; M += 7)
        for (size_t s = 0; s < PD_ARRAY_LEN(dec); s++) fused_case(&c, c.gpu, M, dec[s][0], dec[s][1], dec[s][2]);
    fused_chain_case(&c, 1, 1024, 2816, 5000);
    fused_chain_case(&c, 8, 2048, 1024, 999);
    fused_chain_case(&c, 12, 256, 688, 300);
    pd_backend_free(g_unfused);
    g_unfused = NULL;
    ctx_fini(&c);
}

static void *dev_bytes(ctx *c, pd_backend *b, const uint8_t *h, size_t n);
static float *fp8_dequant(pd_backend *b, const void *d, size_t n_slots, int Hkv, int hd, size_t rb);

// The qkv GEMM with RoPE and the KV write folded in (pd_matmul_params.rope, with or without the
// attention norm): the qkv rows and both caches against the CPU (matmul then rope_kv) and against
// the unfused GPU ops; some tokens have slot -1 (padding: no KV write). fp8: the fallback path.
static void rope_fused_case(ctx *c, int M, int H, int Hkv, int hd, int K, bool norm, bool bias, pd_kv_dtype kvd) {
    int row = (H + 2 * Hkv) * hd, n_slots = 64;
    size_t rb = pd_kv_row_bytes(c->cpu, kvd, Hkv, hd), kvn = (size_t)n_slots * Hkv * hd;
    float *a = rand_f32(c, (size_t)M * K, norm ? 3.0f : 1.0f), *g = rand_f32(c, K, 1.0f);
    float *w = rand_f32(c, (size_t)row * K, 0.05f), *bv = rand_f32(c, row, 0.5f);
    float *kc = rand_f32(c, kvn, 1.0f), *vc = rand_f32(c, kvn, 1.0f);
    uint8_t *init8 = pd_malloc((size_t)n_slots * rb);
    for (size_t i = 0; i < (size_t)n_slots * rb; i++) init8[i] = (uint8_t)(pd_rng_next(&c->rng) & 0x3f);
    float inv_freq[128];
    for (int i = 0; i < hd / 2; i++) inv_freq[i] = powf(500000.0f, -2.0f * i / hd);
    int32_t pos[64], slots[64];
    PD_ASSERT(M <= 64);
    for (int i = 0; i < M; i++) {
        pos[i] = (int32_t)(pd_rng_next(&c->rng) % 9000);
        slots[i] = i % 3 == 2 ? -1 : (int32_t)((i * 37 + 5) % n_slots);
    }
    pd_backend *bs[3] = {c->cpu, c->gpu, c->gpu};  // the third run: the unfused GPU ops
    void *q[3], *k_[3], *v_[3];
    for (int k = 0; k < 3; k++) {
        pd_backend *b = bs[k];
        pd_dtype wdt = pd_backend_weight_dtype(b), adt = pd_backend_act_dtype(b);
        q[k] = dev_out(c, b, (size_t)M * row, adt);
        if (kvd == PD_KV_FP8) {
            k_[k] = dev_bytes(c, b, init8, (size_t)n_slots * rb);
            v_[k] = dev_bytes(c, b, init8, (size_t)n_slots * rb);
        } else {
            k_[k] = dev_act(c, b, kc, kvn);
            v_[k] = dev_act(c, b, vc, kvn);
        }
        pd_rope_kv_params rp = {.qkv = q[k], .positions = dev_i32(c, b, pos, M),
                                .inv_freq = dev_from_f32(c, b, inv_freq, hd / 2, PD_DTYPE_F32),
                                .slot_mapping = dev_i32(c, b, slots, M), .k_cache = k_[k], .v_cache = v_[k],
                                .n_tokens = M, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f,
                                .kv_dtype = kvd};
        void *ad = dev_act(c, b, a, (size_t)M * K), *gd = norm ? dev_from_f32(c, b, g, K, wdt) : NULL;
        pd_matmul_params mp = {.a = ad, .w = dev_from_f32(c, b, w, (size_t)row * K, wdt),
                               .bias = bias ? dev_from_f32(c, b, bv, row, wdt) : NULL, .out = q[k], .M = M, .N = row,
                               .K = K, .norm_w = gd, .norm_eps = 1e-5f, .rope = &rp};
        if (k < 2) {
            pd_op_matmul(b, &mp);
            continue;
        }
        if (norm) {
            void *xn = dev_out(c, b, (size_t)M * K, adt);
            pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = ad, .w = gd, .out = xn, .n_rows = M, .dim = K, .eps = 1e-5f});
            mp.a = xn;
        }
        mp.norm_w = NULL, mp.rope = NULL;
        pd_op_matmul(b, &mp);
        pd_op_rope_kv(b, &rp);
    }
    pd_backend_sync(c->gpu);
    char what[128];
    snprintf(what, sizeof what, "fused rope M=%d H=%d Hkv=%d hd=%d K=%d norm=%d bias=%d kv=%s", M, H, Hkv, hd, K, norm,
             bias, pd_kv_dtype_name(kvd));
    compare(c, q[1], q[0], (size_t)M * row, false, NMSE_GEMM, what);
    float *hf = to_host(c->gpu, q[1], (size_t)M * row, PD_DTYPE_BF16), *hu = to_host(c->gpu, q[2], (size_t)M * row, PD_DTYPE_BF16);
    PD_CHECK_MSG(nmse(hf, hu, (size_t)M * row) <= NMSE_ELEM, "%s: qkv vs the unfused ops: nmse %.3g", what,
                 nmse(hf, hu, (size_t)M * row));
    pd_free(hf), pd_free(hu);
    if (kvd == PD_KV_FP8) {
        float *kg = fp8_dequant(c->gpu, k_[1], n_slots, Hkv, hd, rb), *kr = fp8_dequant(c->cpu, k_[0], n_slots, Hkv, hd, rb);
        float *vg = fp8_dequant(c->gpu, v_[1], n_slots, Hkv, hd, rb), *vr = fp8_dequant(c->cpu, v_[0], n_slots, Hkv, hd, rb);
        PD_CHECK_MSG(nmse(kg, kr, kvn) < 1e-3 && nmse(vg, vr, kvn) < 1e-3, "%s: fp8 caches: nmse k %.3g v %.3g", what,
                     nmse(kg, kr, kvn), nmse(vg, vr, kvn));
        pd_free(kg), pd_free(kr), pd_free(vg), pd_free(vr);
    } else {
        compare(c, k_[1], k_[0], kvn, false, NMSE_GEMM, what);
        compare(c, v_[1], v_[0], kvn, false, NMSE_GEMM, what);
        for (int t = 0; t < 2; t++) {  // the caches equal the unfused GPU ops' (padding slots untouched)
            float *x = to_host(c->gpu, t ? v_[1] : k_[1], kvn, PD_DTYPE_BF16), *y = to_host(c->gpu, t ? v_[2] : k_[2], kvn, PD_DTYPE_BF16);
            PD_CHECK_MSG(nmse(x, y, kvn) <= NMSE_ELEM, "%s: %s cache vs the unfused ops: nmse %.3g", what, t ? "v" : "k",
                         nmse(x, y, kvn));
            pd_free(x), pd_free(y);
        }
    }
    pd_free(a), pd_free(g), pd_free(w), pd_free(bv), pd_free(kc), pd_free(vc), pd_free(init8);
    ctx_release(c);
}

PD_TEST(test_cuda_fused_rope) {
    ctx c;
    if (!ctx_init(&c, 20)) PD_SKIP("%s: no CUDA device", __func__);
    int cfg[][4] = {{4, 2, 64, 256}, {32, 8, 128, 4096}, {4, 1, 32, 200}, {8, 8, 64, 96}, {2, 1, 4, 40}};  // H, Hkv, hd, K
    for (size_t ci = 0; ci < PD_ARRAY_LEN(cfg); ci++)
        for (int M = 1; M <= 9; M++)
            for (int nb = 0; nb < 4; nb++) {
                if (cfg[ci][3] >= 4096 && M % 4 != 1) continue;  // the big shape: M = 1, 5, 9
                rope_fused_case(&c, M, cfg[ci][0], cfg[ci][1], cfg[ci][2], cfg[ci][3], nb & 1, nb & 2, PD_KV_ACT);
            }
    rope_fused_case(&c, 3, 4, 2, 64, 256, true, true, PD_KV_FP8);
    rope_fused_case(&c, 1, 32, 8, 128, 4096, true, false, PD_KV_FP8);
    rope_fused_case(&c, 2, 4, 2, 64, 257, true, false, PD_KV_ACT);  // odd K: the fallback
    rope_fused_case(&c, 2, 4, 1, 6, 64, false, true, PD_KV_ACT);    // head_dim % 4 != 0: the fallback
    ctx_fini(&c);
}

// Backends for the fused forms on the tensor-core kernel: every call on skinny_mma.cu
// (PD_CUDA_SKINNY=2 PD_CUDA_SKINNY_MMA=2), every fused form there from one row
// (PD_CUDA_FUSE_MMA_MIN_M=1, _FORMS=15, up to 16 rows), pipe "0" / "1"; fused = false: the same without the
// fused forms on it (the unfused reference: the same GEMM, so the same sums).
static pd_backend *fused_mma_backend(const char *pipe, bool loads32, bool fused) {
    if (fused)
        setenv("PD_CUDA_FUSE_MMA_MIN_M", "1", 1), setenv("PD_CUDA_SKINNY_FUSE_MAX_M", "16", 1),
            setenv("PD_CUDA_FUSE_MMA_FORMS", "15", 1);
    if (loads32) setenv("PD_CUDA_SKINNY_MMA_LOADS", "32", 1);
    pd_backend *b = skinny_backend(&(skinny_var){.skinny = "2", .mma = "2", .pipe = pipe});
    unsetenv("PD_CUDA_FUSE_MMA_MIN_M"), unsetenv("PD_CUDA_SKINNY_FUSE_MAX_M"), unsetenv("PD_CUDA_FUSE_MMA_FORMS");
    unsetenv("PD_CUDA_SKINNY_MMA_LOADS");
    PD_ASSERT(b);
    return b;
}

// Every fused form on the tensor-core kernel (verify steps: M = k + 1), M = 1..16, random shapes
// (odd N), bias on and off, single- and double-buffered and with 32 loads in flight (plain GEMMs
// included: the unfused reference runs on it); decode-sized shapes; the layer chain;
// the qkv GEMM with RoPE + KV write (head_dim % 16 == 0; head_dim 8: RoPE apart).
PD_TEST(test_cuda_verify_fused) {
    ctx c;
    if (!ctx_init(&c, 24)) PD_SKIP("%s: no CUDA device", __func__);
    pd_backend *dflt = c.gpu;
    for (int var = 0; var < 3; var++) {  // single-buffered, double-buffered, 32 loads in flight
        int pipe = var == 1;
        pd_backend *fm = fused_mma_backend(pipe ? "1" : "0", var == 2, true);
        g_unfused = fused_mma_backend(pipe ? "1" : "0", var == 2, false);
        int Ms[] = {1, 4, 5, 6, 7, 8, 9, 12, 16};
        for (size_t mi = 0; mi < PD_ARRAY_LEN(Ms); mi++) {
            if (var && Ms[mi] % 4 != 1 && Ms[mi] != 8) continue;
            for (size_t f = 0; f < PD_ARRAY_LEN(FUSED_FORMS); f++)
                for (int i = 0; i < 2; i++) {
                    int M = Ms[mi], N = 1 + (int)(pd_rng_next(&c.rng) % 300);
                    int K = 8 * (1 + (int)(pd_rng_next(&c.rng) % (i ? 500 : 20)));
                    fused_case(&c, fm, M, N, K, FUSED_FORMS[f] | (((int)f + i + M) % 2 ? FZ_BIAS : 0));
                }
        }
        int dec[][3] = {{6144, 4096, FZ_NORM | FZ_BIAS}, {4096, 4096, FZ_RES}, {3584, 4096, FZ_NORM | FZ_GLU},
                        {2048, 14336, FZ_RES | FZ_BIAS}, {9000, 4096, FZ_NORM | FZ_F32}};
        for (int M = 5; M <= (var ? 5 : 8); M += 3)  // (the other builds: the verify size only)
            for (size_t s = 0; s < PD_ARRAY_LEN(dec); s++) fused_case(&c, fm, M, dec[s][0], dec[s][1], dec[s][2]);
        c.gpu = fm;
        fused_chain_case(&c, 5, 1024, 2816, 5000);
        if (!var) fused_chain_case(&c, 16, 256, 688, 300);
        int cfg[][4] = {{4, 2, 64, 256}, {32, 8, 128, 4096}, {4, 1, 32, 200}, {8, 8, 64, 96}, {2, 1, 8, 64}};
        for (size_t ci = 0; ci < PD_ARRAY_LEN(cfg); ci++)
            for (int M = 1; M <= 16; M += 1)
                for (int nb = 0; nb < 4; nb++) {
                    if (var && (M != 5 || ci > 1)) continue;  // the other builds: the verify size
                    if (cfg[ci][3] >= 4096 && (M % 4 != 1 || (M > 5 && nb % 2))) continue;
                    rope_fused_case(&c, M, cfg[ci][0], cfg[ci][1], cfg[ci][2], cfg[ci][3], nb & 1, nb & 2, PD_KV_ACT);
                }
        rope_fused_case(&c, 6, 4, 2, 64, 256, true, true, PD_KV_FP8);  // fp8 cache: RoPE apart
        c.gpu = dflt;
        pd_backend_free(fm);
        pd_backend_free(g_unfused);
        g_unfused = NULL;
    }
    // The CUDA-core kernel's other builds: 128 registers at M = 5 (PD_CUDA_SKINNY_OCC4=1), weights
    // through shared memory (PD_CUDA_SKINNY_ASYNC=1, every M): plain and fused.
    const char *knob[2] = {"PD_CUDA_SKINNY_OCC4", "PD_CUDA_SKINNY_ASYNC"};
    for (int v = 0; v < 2; v++) {
        setenv(knob[v], "1", 1);
        pd_backend *o4 = skinny_backend(&(skinny_var){.skinny = "2", .mma = "0"});
        unsetenv(knob[v]);
        PD_REQUIRE(o4 != NULL);
        g_unfused = o4;
        int ms[] = {1, 3, 5, 8};
        for (size_t mi = v ? 0 : 2; mi < (v ? 4 : 3); mi++)
            for (size_t f = 0; f < PD_ARRAY_LEN(FUSED_FORMS); f++)
                for (int i = 0; i < 2; i++) {
                    int N = 1 + (int)(pd_rng_next(&c.rng) % 300), K = 8 * (1 + (int)(pd_rng_next(&c.rng) % (i ? 500 : 20)));
                    fused_case(&c, o4, ms[mi], N, K, FUSED_FORMS[f] | (i ? FZ_BIAS : 0));
                }
        fused_case(&c, o4, 5, 3584, 4096, FZ_NORM | FZ_GLU);
        fused_case(&c, o4, 5, 2048, 14336, FZ_RES | FZ_BIAS);
        c.gpu = o4;
        matmul_case(&c, o4, 5, 4096, 4096, 4096, false, false, false);
        matmul_case(&c, o4, 5, 1027, 14336, 14336, true, false, false);
        if (v) matmul_case(&c, o4, 8, 1027, 4104, 4104, false, true, true);
        for (int nb = 0; nb < 4; nb++) rope_fused_case(&c, 5, 32, 8, 128, 4096, nb & 1, nb & 2, PD_KV_ACT);
        if (v) rope_fused_case(&c, 8, 4, 2, 64, 256, true, true, PD_KV_ACT);
        c.gpu = dflt;
        g_unfused = NULL;
        pd_backend_free(o4);
    }
    ctx_fini(&c);
}


// The batched-decode GEMM (kernels/bgemm.cu, PD_CUDA_BGEMM=1) against the CPU reference: M = 17..64
// on shapes with one tile, a partial last tile (N % 128 == 64), split-K (tiles < 2 x SMs: several
// blocks per tile, partials in the scratch) and no split, every flag, lda > K; the glu form (SwiGLU
// in the epilogue, with and without the norm before it) and the rope form (RoPE + KV write in the
// epilogue) against the CPU and the unfused ops; a PDL chain. Shapes alternate so that calls of other splits reuse the tile counters.
PD_TEST(test_cuda_bgemm) {
    ctx c;
    if (!ctx_init(&c, 23)) PD_SKIP("%s: no CUDA device", __func__);
    setenv("PD_CUDA_BGEMM", "1", 1);
    pd_err err = {0};
    pd_backend *bg = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_BGEMM");
    PD_REQUIRE(bg);
    PD_CHECK(pd_backend_fuses_epilogues(bg, 17) && pd_backend_fuses_epilogues(bg, 64) && !pd_backend_fuses_epilogues(bg, 16) &&
             !pd_backend_fuses_epilogues(bg, 65));
    pd_backend *dflt = c.gpu;
    c.gpu = bg;
    int Ms[] = {17, 24, 40, 64}, NKs[][2] = {{64, 64}, {1984, 2048}, {512, 1024}, {6144, 4096}, {4096, 4096}, {4096, 14336},
                                            {9024, 512}};
    for (size_t mi = 0; mi < PD_ARRAY_LEN(Ms); mi++)
        for (size_t nk = 0; nk < PD_ARRAY_LEN(NKs); nk++) {
            int flags = (int)((mi + 3 * nk) % 8), M = Ms[mi], N = NKs[nk][0], K = NKs[nk][1];
            matmul_case(&c, bg, M, N, K, nk % 3 == 1 ? K + 8 : K, flags & 1, flags & 2, flags & 4);
        }
    g_unfused = bg;
    int glu[][3] = {{64, 64, FZ_GLU}, {3584, 4096, FZ_GLU}, {1792, 1024, FZ_NORM | FZ_GLU | FZ_BIAS}, {14336, 4096, FZ_GLU}};
    for (size_t mi = 0; mi < PD_ARRAY_LEN(Ms); mi++)
        for (size_t s = 0; s < PD_ARRAY_LEN(glu); s++)
            if (mi == 3 || s < 3) fused_case(&c, bg, Ms[mi], glu[s][0], glu[s][1], glu[s][2]);
    g_unfused = NULL;
    for (int M = 17; M <= 64; M += 23)  // qkv with RoPE + KV write in the epilogue (head_dim 128), fp8: rope_kv after
        for (int nb = 0; nb < 4; nb++) rope_fused_case(&c, M, nb < 2 ? 32 : 4, nb < 2 ? 8 : 2, 128, nb < 2 ? 4096 : 512, nb & 1, nb & 2, PD_KV_ACT);
    rope_fused_case(&c, 64, 32, 8, 128, 4096, true, false, PD_KV_FP8);
    rope_fused_case(&c, 24, 4, 2, 64, 256, false, true, PD_KV_ACT);  // head_dim 64: rope_kv after the GEMM
    matmul_chain_case(&c, 64, 2048, 1024, 512);
    matmul_chain_case(&c, 33, 4096, 4096, 1024);
    // the 8-stage ring (one block per SM, its own split sizing)
    setenv("PD_CUDA_BGEMM", "1", 1);
    setenv("PD_CUDA_BGEMM_STAGES", "8", 1);
    pd_backend *bg8 = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_BGEMM_STAGES");
    unsetenv("PD_CUDA_BGEMM");
    PD_REQUIRE(bg8);
    c.gpu = bg8;
    for (size_t nk = 0; nk < PD_ARRAY_LEN(NKs); nk++)
        matmul_case(&c, bg8, nk % 2 ? 64 : 29, NKs[nk][0], NKs[nk][1], NKs[nk][1], nk & 1, nk & 2, nk == 6);
    g_unfused = bg8;
    fused_case(&c, bg8, 64, 3584, 4096, FZ_GLU);
    g_unfused = NULL;
    rope_fused_case(&c, 48, 32, 8, 128, 4096, true, true, PD_KV_ACT);
    matmul_chain_case(&c, 64, 2048, 1024, 512);
    pd_backend_free(bg8);
    c.gpu = dflt;
    pd_backend_free(bg);
    ctx_fini(&c);
}

// K not a multiple of 8 (odd and even): the skinny kernel does not take these, the unfused fallback
// (rmsnorm / cuBLASLt / silu_mul through the backend's scratch) does.
PD_TEST(test_cuda_fused_odd_k) {
    ctx c;
    if (!ctx_init(&c, 19)) PD_SKIP("%s: no CUDA device", __func__);
    g_unfused = NULL;  // (no skinny kernel here: the fallback's GEMM is the default backend's)
    for (int M = 1; M <= 9; M += 4)
        for (size_t f = 0; f < PD_ARRAY_LEN(FUSED_FORMS); f++) {
            int N = 1 + (int)(pd_rng_next(&c.rng) % 200), K = 1 + 2 * (int)(pd_rng_next(&c.rng) % 150) + (int)(f % 2);
            if (K % 8 == 0) K++;
            fused_case(&c, c.gpu, M, N, K, FUSED_FORMS[f] | (f % 2 ? FZ_BIAS : 0));
        }
    ctx_fini(&c);
}

// ---- rope + paged KV write ---------------------------------------------------------------------

static void *dev_bytes(ctx *c, pd_backend *b, const uint8_t *h, size_t n);
static float *fp8_dequant(pd_backend *b, const void *d, size_t n_slots, int Hkv, int hd, size_t rb);

PD_TEST(test_cuda_rope_kv) {
    ctx c;
    if (!ctx_init(&c, 6)) PD_SKIP("%s: no CUDA device", __func__);
    int cfg[][3] = {{4, 2, 64}, {32, 8, 128}, {4, 1, 32}, {8, 8, 64}};  // H, Hkv, hd
    int ns[] = {1, 17, 300};  // 300: the 16-byte kernel of large steps (PD_CUDA_ROPE_VEC_MIN, 256), some slots -1
    for (size_t ci = 0; ci < PD_ARRAY_LEN(cfg); ci++)
        for (size_t ni = 0; ni < PD_ARRAY_LEN(ns); ni++) {
            int H = cfg[ci][0], Hkv = cfg[ci][1], hd = cfg[ci][2], n = ns[ni], bsz = 16, n_blocks = n > 48 ? n / bsz + 4 : 4;
            int n_slots = bsz * n_blocks, row = (H + 2 * Hkv) * hd;
            float scaling = ni ? 0.9f : 1.0f;
            float *qkv = rand_f32(&c, (size_t)n * row, 1.0f);
            float *kc = rand_f32(&c, (size_t)n_slots * Hkv * hd, 1.0f), *vc = rand_f32(&c, (size_t)n_slots * Hkv * hd, 1.0f);
            float inv_freq[64];
            for (int i = 0; i < hd / 2; i++) inv_freq[i] = powf(500000.0f, -2.0f * i / hd);
            int32_t pos[300], slots[300];
            for (int i = 0; i < n; i++) {
                pos[i] = (int32_t)(pd_rng_next(&c.rng) % 9000);
                slots[i] = (int32_t)((i * 37 + 5) % n_slots);  // distinct slots (37 is prime to n_slots)
                if (n > 17 && i % 97 == 13) slots[i] = -1;     // no KV write for this token
            }
            pd_backend *bs[2] = {c.cpu, c.gpu};
            void *q[2], *k_[2], *v_[2];
            for (int k = 0; k < 2; k++) {
                size_t kvn = (size_t)n_slots * Hkv * hd;
                pd_rope_kv_params p = {.qkv = q[k] = dev_act(&c, bs[k], qkv, (size_t)n * row),
                                       .positions = dev_i32(&c, bs[k], pos, n),
                                       .inv_freq = dev_from_f32(&c, bs[k], inv_freq, hd / 2, PD_DTYPE_F32),
                                       .slot_mapping = dev_i32(&c, bs[k], slots, n),
                                       .k_cache = k_[k] = dev_act(&c, bs[k], kc, kvn),
                                       .v_cache = v_[k] = dev_act(&c, bs[k], vc, kvn),
                                       .n_tokens = n, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                       .attn_scaling = scaling};
                pd_op_rope_kv(bs[k], &p);
            }
            size_t kvn = (size_t)n_slots * Hkv * hd;
            compare(&c, q[1], q[0], (size_t)n * row, false, NMSE_ELEM_HF, "rope qkv");
            compare(&c, k_[1], k_[0], kvn, false, NMSE_ELEM_HF, "rope k_cache");
            compare(&c, v_[1], v_[0], kvn, false, 0.0, "rope v_cache");
            // fp8 cache: the same write quantised. V (not rotated) gets identical bytes and scales on
            // both backends; K (rotated with bf16 roundings on the GPU, f32 on the CPU) differs by at
            // most a step here and there; untouched slots keep their contents.
            size_t rb = pd_kv_row_bytes(c.cpu, PD_KV_FP8, Hkv, hd);
            uint8_t *init = pd_malloc((size_t)n_slots * rb);
            for (size_t i = 0; i < (size_t)n_slots * rb; i++) init[i] = (uint8_t)(pd_rng_next(&c.rng) & 0x3f);
            void *k8[2], *v8[2];
            for (int k = 0; k < 2; k++) {
                pd_rope_kv_params p = {.qkv = dev_act(&c, bs[k], qkv, (size_t)n * row),
                                       .positions = dev_i32(&c, bs[k], pos, n),
                                       .inv_freq = dev_from_f32(&c, bs[k], inv_freq, hd / 2, PD_DTYPE_F32),
                                       .slot_mapping = dev_i32(&c, bs[k], slots, n),
                                       .k_cache = k8[k] = dev_bytes(&c, bs[k], init, (size_t)n_slots * rb),
                                       .v_cache = v8[k] = dev_bytes(&c, bs[k], init, (size_t)n_slots * rb),
                                       .n_tokens = n, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                       .attn_scaling = scaling, .kv_dtype = PD_KV_FP8};
                pd_op_rope_kv(bs[k], &p);
            }
            uint8_t *vg = pd_malloc((size_t)n_slots * rb), *vr = pd_malloc((size_t)n_slots * rb);
            pd_backend_download(c.gpu, vg, v8[1], (size_t)n_slots * rb);
            pd_backend_download(c.cpu, vr, v8[0], (size_t)n_slots * rb);
            PD_CHECK_MSG(!memcmp(vg, vr, (size_t)n_slots * rb), "rope fp8 v_cache bytes differ (H=%d Hkv=%d hd=%d n=%d)",
                         H, Hkv, hd, n);
            float *kg = fp8_dequant(c.gpu, k8[1], n_slots, Hkv, hd, rb), *kr = fp8_dequant(c.cpu, k8[0], n_slots, Hkv, hd, rb);
            double e = nmse(kg, kr, kvn);
            PD_CHECK_MSG(e < 1e-3, "rope fp8 k_cache: nmse %.3g (H=%d Hkv=%d hd=%d n=%d)", e, H, Hkv, hd, n);
            pd_free(init), pd_free(vg), pd_free(vr), pd_free(kg), pd_free(kr);
            pd_free(qkv);
            pd_free(kc);
            pd_free(vc);
            ctx_release(&c);
        }
    ctx_fini(&c);
}

// ---- transformers' bf16 rounding points ---------------------------------------------------------

static float bfr(float x) { return pd_bf16_to_f32(pd_f32_to_bf16(x)); }

// Counts the elements of got (bf16 values) that differ from want (bf16-exact floats): *n_diff in
// all, *n_far by more than one bf16 step.
static void bf16_diff(const float *got, const float *want, size_t n, size_t *n_diff, size_t *n_far) {
    *n_diff = *n_far = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t a = pd_f32_to_bf16(got[i]), b = pd_f32_to_bf16(want[i]);
        if (a == b) continue;
        (*n_diff)++;
        if (((a ^ b) & 0x8000) || abs(a - b) > 1) (*n_far)++;
    }
}

// The GPU rmsnorm, silu_mul and rope_kv give transformers' bf16 results: a host emulation that
// rounds where transformers does (LlamaRMSNorm's cast before the weight, act_fn(gate) before the
// product, bf16 cos/sin and each term of q*cos + rotate_half(q)*sin) matches bit for bit except
// for a few differences (fast-math exp/rsqrt/sincos), and it matches clearly better than an
// emulation that rounds only each op's result.
PD_TEST(test_cuda_hf_rounding) {
    ctx c;
    if (!ctx_init(&c, 31)) PD_SKIP("%s: no CUDA device", __func__);
    int n = 7, dim = 4096, F = 1376, H = 8, Hkv = 2, hd = 128;
    size_t nd = (size_t)n * dim;
    float *x = rand_f32(&c, nd, 2.0f), *a = rand_f32(&c, nd, 1.0f), *w = rand_f32(&c, dim, 1.0f);
    float *gu = rand_f32(&c, (size_t)n * 2 * F, 3.0f);
    int row = (H + 2 * Hkv) * hd;
    float *qkv = rand_f32(&c, (size_t)n * row, 1.0f);
    for (size_t i = 0; i < nd; i++) x[i] = bfr(x[i]), a[i] = bfr(a[i]);
    for (int i = 0; i < dim; i++) w[i] = bfr(w[i]);
    for (size_t i = 0; i < (size_t)n * 2 * F; i++) gu[i] = bfr(gu[i]);
    for (size_t i = 0; i < (size_t)n * row; i++) qkv[i] = bfr(qkv[i]);
    size_t total = nd + (size_t)n * F + (size_t)n * (H + Hkv) * hd;
    float *hf = pd_malloc(sizeof(float) * total), *once = pd_malloc(sizeof(float) * total);
    float *got = pd_malloc(sizeof(float) * total);

    // rmsnorm with a residual add
    void *xd = dev_act(&c, c.gpu, x, nd), *out = dev_out(&c, c.gpu, nd, PD_DTYPE_BF16);
    pd_op_rmsnorm(c.gpu, &(pd_rmsnorm_params){.x = xd, .add = dev_act(&c, c.gpu, a, nd),
                                              .w = dev_from_f32(&c, c.gpu, w, dim, PD_DTYPE_BF16), .out = out,
                                              .n_rows = n, .dim = dim, .eps = 1e-5f});
    float *g0 = to_host(c.gpu, out, nd, PD_DTYPE_BF16);
    memcpy(got, g0, sizeof(float) * nd);
    pd_free(g0);
    for (int r = 0; r < n; r++) {
        double ss = 0;
        float v[4096];
        for (int i = 0; i < dim; i++) v[i] = bfr(x[(size_t)r * dim + i] + a[(size_t)r * dim + i]), ss += (double)v[i] * v[i];
        float inv = (float)(1.0 / sqrt(ss / dim + 1e-5));
        for (int i = 0; i < dim; i++) {
            hf[(size_t)r * dim + i] = bfr(w[i] * bfr(v[i] * inv));
            once[(size_t)r * dim + i] = bfr(w[i] * (v[i] * inv));
        }
    }
    // silu_mul
    size_t o1 = nd;
    void *so = dev_out(&c, c.gpu, (size_t)n * F, PD_DTYPE_BF16);
    pd_op_silu_mul(c.gpu, &(pd_silu_mul_params){.gu = dev_act(&c, c.gpu, gu, (size_t)n * 2 * F), .out = so, .n_rows = n,
                                                .F = F});
    g0 = to_host(c.gpu, so, (size_t)n * F, PD_DTYPE_BF16);
    memcpy(got + o1, g0, sizeof(float) * (size_t)n * F);
    pd_free(g0);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < F; i++) {
            float g = gu[(size_t)r * 2 * F + i], u = gu[(size_t)r * 2 * F + F + i];
            float sl = (float)(g / (1.0 + exp(-(double)g)));
            hf[o1 + (size_t)r * F + i] = bfr(bfr(sl) * u);
            once[o1 + (size_t)r * F + i] = bfr(sl * u);
        }
    // rope on q and k (no cache write: slot -1)
    size_t o2 = o1 + (size_t)n * F;
    float inv_freq[64];
    for (int i = 0; i < hd / 2; i++) inv_freq[i] = powf(500000.0f, -2.0f * i / hd);
    int32_t pos[7], slots[7];
    for (int i = 0; i < n; i++) pos[i] = (int32_t)(pd_rng_next(&c.rng) % 9000), slots[i] = -1;
    void *qd = dev_act(&c, c.gpu, qkv, (size_t)n * row);
    pd_op_rope_kv(c.gpu, &(pd_rope_kv_params){.qkv = qd, .positions = dev_i32(&c, c.gpu, pos, n),
                                              .inv_freq = dev_from_f32(&c, c.gpu, inv_freq, hd / 2, PD_DTYPE_F32),
                                              .slot_mapping = dev_i32(&c, c.gpu, slots, n), .n_tokens = n,
                                              .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f});
    g0 = to_host(c.gpu, qd, (size_t)n * row, PD_DTYPE_BF16);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H + Hkv; h++)
            for (int i = 0; i < hd; i++) {
                size_t src = (size_t)t * row + (size_t)h * hd, dst = o2 + ((size_t)t * (H + Hkv) + h) * hd;
                got[dst + i] = g0[src + i];
                int j = i % (hd / 2);
                float ang = (float)pos[t] * inv_freq[j];
                float cs = (float)cos((double)ang), sn = (float)sin((double)ang);
                float x0 = qkv[src + j], x1 = qkv[src + j + hd / 2];
                if (i < hd / 2) {
                    hf[dst + i] = bfr(bfr(x0 * bfr(cs)) - bfr(x1 * bfr(sn)));
                    once[dst + i] = bfr(x0 * cs - x1 * sn);
                } else {
                    hf[dst + i] = bfr(bfr(x1 * bfr(cs)) + bfr(x0 * bfr(sn)));
                    once[dst + i] = bfr(x1 * cs + x0 * sn);
                }
            }
    pd_free(g0);
    size_t seg[4] = {0, o1, o2, total};
    const char *names[3] = {"rmsnorm", "silu_mul", "rope"};
    for (int k = 0; k < 3; k++) {
        size_t m = seg[k + 1] - seg[k], d_hf, far_hf, d_once, far_once;
        bf16_diff(got + seg[k], hf + seg[k], m, &d_hf, &far_hf);
        bf16_diff(got + seg[k], once + seg[k], m, &d_once, &far_once);
        printf("  %-8s vs transformers' rounding: %zu of %zu differ (%zu by > 1 step); vs one rounding: %zu\n",
               names[k], d_hf, m, far_hf, d_once);
        // rope: the fast sincos can move a bf16 cos/sin by one step, and cancellation in the sum
        // can turn that into several steps of the result; rare, so only the count is bounded.
        PD_CHECK_MSG(k == 2 || far_hf == 0, "%s: %zu elements more than one bf16 step from transformers' rounding",
                     names[k], far_hf);
        PD_CHECK_MSG(d_hf * 100 <= (size_t)(k == 2 ? 3 : 1) * m, "%s: %zu of %zu differ from transformers' rounding",
                     names[k], d_hf, m);
        PD_CHECK_MSG(d_once >= 4 * d_hf + 10, "%s: no closer to transformers' rounding (%zu) than to one rounding (%zu)",
                     names[k], d_hf, d_once);
    }
    pd_free(x), pd_free(a), pd_free(w), pd_free(gu), pd_free(qkv), pd_free(hf), pd_free(once), pd_free(got);
    ctx_fini(&c);
}

// ---- fp8 KV (backend.h, PD_KV_FP8) ---------------------------------------------------------------

static void *dev_bytes(ctx *c, pd_backend *b, const uint8_t *h, size_t n);

// Quantises n_slots rows of Hkv * hd floats into fp8 rows of rb bytes the way the KV write does
// (per-head scale amax / 448); the result is byte-identical input for either backend.
static uint8_t *fp8_rows(const float *x, size_t n_slots, int Hkv, int hd, size_t rb) {
    uint8_t *o = pd_calloc(n_slots ? n_slots : 1, rb);
    for (size_t sl = 0; sl < n_slots; sl++) {
        uint8_t *row = o + sl * rb;
        for (int h = 0; h < Hkv; h++) {
            const float *xh = x + (sl * Hkv + h) * hd;
            float amax = 0.0f;
            for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(xh[i]));
            float inv = amax > 0.0f ? 448.0f / amax : 0.0f, scale = amax / 448.0f;
            for (int i = 0; i < hd; i++) row[(size_t)h * hd + i] = pd_fp8_e4m3_from_f32(xh[i] * inv);
            memcpy(row + (size_t)Hkv * hd + 4 * (size_t)h, &scale, 4);
        }
    }
    return o;
}

// Dequantised contents (n_slots * Hkv * hd floats) of fp8 rows downloaded from backend b.
static float *fp8_dequant(pd_backend *b, const void *d, size_t n_slots, int Hkv, int hd, size_t rb) {
    uint8_t *h = pd_malloc(n_slots * rb);
    pd_backend_download(b, h, d, n_slots * rb);
    float *o = pd_malloc(sizeof(float) * n_slots * Hkv * hd);
    for (size_t sl = 0; sl < n_slots; sl++)
        for (int k = 0; k < Hkv; k++) {
            float sc;
            memcpy(&sc, h + sl * rb + (size_t)Hkv * hd + 4 * (size_t)k, 4);
            for (int i = 0; i < hd; i++)
                o[(sl * Hkv + k) * hd + i] = pd_fp8_e4m3_to_f32(h[sl * rb + (size_t)k * hd + i]) * sc;
        }
    pd_free(h);
    return o;
}

// The host E4M3 conversions against the format's definition (no GPU needed).
PD_TEST(test_fp8_e4m3_host) {
    PD_CHECK(pd_fp8_e4m3_to_f32(0x7e) == 448.0f && pd_fp8_e4m3_to_f32(0x01) == 0x1p-9f);
    PD_CHECK(pd_fp8_e4m3_to_f32(0x08) == 0x1p-6f && pd_fp8_e4m3_to_f32(0x38) == 1.0f);
    PD_CHECK(isnan(pd_fp8_e4m3_to_f32(0x7f)) && isnan(pd_fp8_e4m3_to_f32(0xff)));
    for (int v = 0; v < 256; v++) {
        if ((v & 0x7f) == 0x7f) continue;
        float f = pd_fp8_e4m3_to_f32((uint8_t)v);
        PD_CHECK_MSG(pd_fp8_e4m3_from_f32(f) == v, "code 0x%02x (%g) does not round-trip", v, f);
        if ((v & 0x7f) < 0x7e) {  // the midpoint to the next magnitude rounds to the even code
            float g = pd_fp8_e4m3_to_f32((uint8_t)(v + 1)), mid = 0.5f * (f + g);
            int want = (v & 1) ? v + 1 : v;
            PD_CHECK_MSG(pd_fp8_e4m3_from_f32(mid) == want, "midpoint of 0x%02x: got 0x%02x", v,
                         pd_fp8_e4m3_from_f32(mid));
        }
    }
    PD_CHECK(pd_fp8_e4m3_from_f32(1e6f) == 0x7e && pd_fp8_e4m3_from_f32(-449.0f) == 0xfe);
    PD_CHECK(pd_fp8_e4m3_from_f32(NAN) == 0x7f && pd_fp8_e4m3_from_f32(0x1p-11f) == 0x00);
    pd_backend *cpu = pd_backend_cpu_new(1);
    PD_CHECK(pd_kv_row_bytes(cpu, PD_KV_FP8, 8, 128) == 1056 && pd_kv_row_bytes(cpu, PD_KV_FP8, 1, 32) == 48);
    PD_CHECK(pd_kv_row_bytes(cpu, PD_KV_ACT, 8, 128) == 4096);
    pd_kv_dtype t;
    PD_CHECK(pd_kv_dtype_parse("fp8", &t) && t == PD_KV_FP8 && pd_kv_dtype_parse("auto", &t) && t == PD_KV_ACT);
    PD_CHECK(!pd_kv_dtype_parse("fp16", &t));
    pd_backend_free(cpu);
}

// ---- attention ---------------------------------------------------------------------------------

typedef struct attn_case {
    int H, Hkv, hd, bs;
    int n_seqs;
    int q_lens[24], kv_lens[24];
    bool fp8;  // the caches hold fp8 rows (the same bytes on both backends)
    // > 0: every V head row is scaled by 2^u, u uniform in [-spread, spread] (K: [-min(spread/4, 2),
    // min(spread/4, 2)]), and about one in
    // 16 V head rows is all zero (fp8 scale 0): per-token scales far apart (the streaming fp8
    // decode kernel weights P by V's scale in a frame of its own)
    int spread;
} attn_case;

// Builds the batch (blocks drawn from a shuffled pool, so pages are scattered), runs it on
// backend b and returns the output pointer. Same rng seed -> same inputs on both backends.
static void *attn_run(ctx *c, pd_backend *b, const attn_case *ac, uint64_t seed, int *n_tokens_out) {
    pd_rng r;
    pd_rng_seed(&r, seed);
    int n_tok = 0, n_bt = 0, max_q = 0, max_kv = 0;
    int32_t q_indptr[25] = {0}, bt_indptr[25] = {0};
    for (int s = 0; s < ac->n_seqs; s++) {
        n_tok += ac->q_lens[s];
        q_indptr[s + 1] = n_tok;
        n_bt += (ac->kv_lens[s] + ac->bs - 1) / ac->bs;
        bt_indptr[s + 1] = n_bt;
        max_q = PD_MAX(max_q, ac->q_lens[s]);
        max_kv = PD_MAX(max_kv, ac->kv_lens[s]);
    }
    int n_blocks = n_bt + 3;
    int32_t *pool = pd_malloc(sizeof(int32_t) * n_blocks), *tseq = pd_malloc(sizeof(int32_t) * n_tok);
    for (int i = 0; i < n_blocks; i++) pool[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = (int)(pd_rng_next(&r) % (uint64_t)(i + 1)), t = pool[i];
        pool[i] = pool[j];
        pool[j] = t;
    }
    for (int s = 0; s < ac->n_seqs; s++)
        for (int i = q_indptr[s]; i < q_indptr[s + 1]; i++) tseq[i] = s;
    // Logical K/V per (sequence, position) are drawn independently of the page layout and
    // scattered into the pages; unused slots get other random values.
    size_t kvw = (size_t)ac->Hkv * ac->hd, kvn = (size_t)n_blocks * ac->bs * kvw, qn = (size_t)n_tok * ac->H * ac->hd;
    pd_rng save = c->rng, r2;
    pd_rng_seed(&r2, seed + 1);  // logical contents: independent of block size and shuffle
    c->rng = r2;
    float *q = rand_f32(c, qn, 1.0f);
    r2 = c->rng;
    c->rng = r;
    float *kc = rand_f32(c, kvn, 1.0f), *vc = rand_f32(c, kvn, 1.0f);
    c->rng = r2;
    for (int s = 0; s < ac->n_seqs; s++) {
        for (int j = 0; j < ac->kv_lens[s]; j++) {
            size_t slot = (size_t)pool[bt_indptr[s] + j / ac->bs] * ac->bs + (size_t)(j % ac->bs);
            for (size_t e = 0; e < kvw; e++) {
                kc[slot * kvw + e] = pd_bf16_to_f32(pd_f32_to_bf16(pd_rng_normal(&c->rng)));
                vc[slot * kvw + e] = pd_bf16_to_f32(pd_f32_to_bf16(pd_rng_normal(&c->rng)));
            }
            for (int h = 0; ac->spread > 0 && h < ac->Hkv; h++) {
                int sk = ac->spread / 4 < 2 ? ac->spread / 4 : 2;  // K: at most 2^±2 (scores stay a softmax)
                float fk = ldexpf(1.0f, (int)(pd_rng_next(&c->rng) % (uint64_t)(2 * sk + 1)) - sk);
                float fv = ldexpf(1.0f, (int)(pd_rng_next(&c->rng) % (uint64_t)(2 * ac->spread + 1)) - ac->spread);
                if (pd_rng_next(&c->rng) % 16 == 0) fv = 0.0f;
                for (int e = 0; e < ac->hd; e++) {
                    kc[slot * kvw + (size_t)h * ac->hd + e] *= fk;
                    vc[slot * kvw + (size_t)h * ac->hd + e] *= fv;
                }
            }
        }
    }
    c->rng = save;
    void *kd, *vd;
    if (ac->fp8) {
        size_t rb = pd_kv_row_bytes(b, PD_KV_FP8, ac->Hkv, ac->hd), n_slots = (size_t)n_blocks * ac->bs;
        uint8_t *k8 = fp8_rows(kc, n_slots, ac->Hkv, ac->hd, rb), *v8 = fp8_rows(vc, n_slots, ac->Hkv, ac->hd, rb);
        kd = dev_bytes(c, b, k8, n_slots * rb);
        vd = dev_bytes(c, b, v8, n_slots * rb);
        pd_free(k8), pd_free(v8);
    } else {
        kd = dev_act(c, b, kc, kvn);
        vd = dev_act(c, b, vc, kvn);
    }
    pd_attention_params p = {
        .q = dev_act(c, b, q, qn), .k_cache = kd, .v_cache = vd, .kv_dtype = ac->fp8 ? PD_KV_FP8 : PD_KV_ACT,
        .out = dev_out(c, b, qn, pd_backend_act_dtype(b)), .q_indptr = dev_i32(c, b, q_indptr, ac->n_seqs + 1),
        .kv_lens = dev_i32(c, b, ac->kv_lens, ac->n_seqs), .bt_indptr = dev_i32(c, b, bt_indptr, ac->n_seqs + 1),
        .bt_indices = dev_i32(c, b, pool, n_bt), .token_seq = dev_i32(c, b, tseq, n_tok), .n_tokens = n_tok,
        .n_seqs = ac->n_seqs, .n_heads = ac->H, .n_kv_heads = ac->Hkv, .head_dim = ac->hd, .block_size = ac->bs,
        .q_stride = ac->H * ac->hd, .max_q_len = max_q, .max_kv_len = max_kv, .scale = 1.0f / sqrtf((float)ac->hd)};
    pd_op_attention(b, &p);
    pd_free(kc);
    pd_free(vc);
    pd_free(q);
    pd_free(pool);
    pd_free(tseq);
    *n_tokens_out = n_tok;
    return p.out;
}

static void attn_check(ctx *c, const attn_case *ac, const char *name) {
    int n_tok = 0;
    void *ref = attn_run(c, c->cpu, ac, 77, &n_tok);
    void *got = attn_run(c, c->gpu, ac, 77, &n_tok);
    char what[160];
    snprintf(what, sizeof what, "attention %s%s H=%d Hkv=%d hd=%d bs=%d seqs=%d", ac->fp8 ? "fp8 " : "", name, ac->H,
             ac->Hkv, ac->hd, ac->bs, ac->n_seqs);
    compare(c, got, ref, (size_t)n_tok * ac->H * ac->hd, false, NMSE_ATTN, what);
    ctx_release(c);
}

// The case on bf16 caches and again on fp8 caches (GPU vs CPU on the same fp8 bytes).
static void attn_check_gpu(ctx *c, const attn_case *ac, const char *name) {
    attn_check(c, ac, name);
    attn_case f = *ac;
    f.fp8 = true;
    attn_check(c, &f, name);
}

// attn_check_gpu plus the cost of fp8 itself: the CPU result on the fp8 cache vs the CPU result on
// the unquantised values.
static void attn_check_both(ctx *c, const attn_case *ac, const char *name) {
    attn_check_gpu(c, ac, name);
    attn_case f = *ac;
    f.fp8 = true;
    int n_tok = 0;
    size_t n = 0;
    for (int s = 0; s < ac->n_seqs; s++) n += (size_t)ac->q_lens[s] * ac->H * ac->hd;
    float *q8 = to_host(c->cpu, attn_run(c, c->cpu, &f, 77, &n_tok), n, PD_DTYPE_F32);
    float *qx = to_host(c->cpu, attn_run(c, c->cpu, ac, 77, &n_tok), n, PD_DTYPE_F32);
    double e = nmse(q8, qx, n);
    PD_CHECK_MSG(e < 5e-3, "attention %s: fp8 cache vs exact nmse %.3g", name, e);
    pd_free(q8), pd_free(qx);
    ctx_release(c);
}

PD_TEST(test_cuda_attention_decode) {
    ctx c;
    if (!ctx_init(&c, 7)) PD_SKIP("%s: no CUDA device", __func__);
    int heads[][2] = {{4, 4}, {8, 2}, {16, 2}, {7, 1}};
    int hds[] = {64, 128, 32}, bss[] = {16, 1, 7, 32};
    for (size_t hi = 0; hi < PD_ARRAY_LEN(heads); hi++)
        for (size_t di = 0; di < PD_ARRAY_LEN(hds); di++) {
            attn_case ac = {.H = heads[hi][0], .Hkv = heads[hi][1], .hd = hds[di], .bs = bss[(hi + di) % 4], .n_seqs = 17};
            int kvs[] = {1, 54, 97, 2047, 3, 16, 17, 600};
            for (int s = 0; s < 17; s++) {
                ac.q_lens[s] = 1;
                ac.kv_lens[s] = kvs[s % 8] + (s / 8);
            }
            attn_check_both(&c, &ac, "decode x17");
            attn_case one = {.H = heads[hi][0], .Hkv = heads[hi][1], .hd = hds[di], .bs = 16, .n_seqs = 1,
                             .q_lens = {1}, .kv_lens = {hi == 0 ? 9000 : 2047}};
            attn_check_both(&c, &one, "decode x1 long");
        }
    ctx_fini(&c);
}

// A graph step's decode attention on the card two ways, from the same qkv rows and caches, each
// right after the rope_kv kernel that writes the step's new rows: n_new = 0 (every K/V row read
// after the PDL wait: test_cuda_attention_decode checks that kernel against the CPU) and n_new = 1
// (the rows before each sequence's new one loaded before the wait, while rope_kv runs). Both give
// the same bytes: outputs and both caches. The new rows' slots hold other random values before
// rope_kv, so a new row read early would change the result. One sequence writes no KV (slot -1,
// a padding row): its cache is untouched. Contexts 1 to 2049, one-wave (8-warp, in-place merge)
// and multi-wave (4-warp) grids, GQA groups 4 and 1, head_dim 64 and 128.
PD_TEST(test_cuda_attention_decode_early) {
    ctx c;
    if (!ctx_init(&c, 12)) PD_SKIP("%s: no CUDA device", __func__);
    int cfg[][4] = {{32, 8, 128, 5}, {8, 8, 64, 5}, {32, 8, 128, 60}, {16, 4, 64, 24}};  // H, Hkv, hd, sequences
    int lens[] = {1, 2, 17, 128, 129, 600, 2049, 16, 33, 255};
    for (size_t ci = 0; ci < PD_ARRAY_LEN(cfg); ci++) {
        int H = cfg[ci][0], Hkv = cfg[ci][1], hd = cfg[ci][2], n = cfg[ci][3], bsz = 16, row = (H + 2 * Hkv) * hd;
        int32_t qi[61], kvl[60], bti[61], pos[60], slots[60], max_kv = 0, n_bt = 0;
        for (int s = 0; s < n; s++) {
            kvl[s] = lens[(s + (int)ci) % 10] + s / 10;
            max_kv = kvl[s] > max_kv ? kvl[s] : max_kv;
            qi[s] = s, bti[s] = n_bt;
            n_bt += (kvl[s] + bsz - 1) / bsz;
        }
        qi[n] = n, bti[n] = n_bt;
        int32_t *bt = pd_malloc(sizeof(int32_t) * (size_t)n_bt);
        for (int j = 0; j < n_bt; j++) bt[j] = (int32_t)(((int64_t)j * 7919 + 3) % n_bt);  // a permutation (7919 prime)
        int pad = n - 2;  // this sequence writes no KV
        for (int s = 0; s < n; s++) {
            pos[s] = kvl[s] - 1;
            slots[s] = s == pad ? -1 : bt[bti[s] + pos[s] / bsz] * bsz + pos[s] % bsz;
        }
        size_t kvn = (size_t)n_bt * bsz * Hkv * hd, no = (size_t)n * H * hd;
        float *qkv = rand_f32(&c, (size_t)n * row, 1.0f), *kc = rand_f32(&c, kvn, 1.0f), *vc = rand_f32(&c, kvn, 1.0f);
        float inv_freq[64];
        for (int i = 0; i < hd / 2; i++) inv_freq[i] = powf(500000.0f, -2.0f * i / hd);
        uint16_t *res[2][3];  // per way: out, k cache, v cache
        for (int way = 0; way < 2; way++) {
            void *q = dev_act(&c, c.gpu, qkv, (size_t)n * row), *kd = dev_act(&c, c.gpu, kc, kvn), *vd = dev_act(&c, c.gpu, vc, kvn);
            pd_rope_kv_params r = {.qkv = q, .positions = dev_i32(&c, c.gpu, pos, n),
                                   .inv_freq = dev_from_f32(&c, c.gpu, inv_freq, hd / 2, PD_DTYPE_F32),
                                   .slot_mapping = dev_i32(&c, c.gpu, slots, n), .k_cache = kd, .v_cache = vd,
                                   .n_tokens = n, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f};
            void *out = dev_out(&c, c.gpu, no, PD_DTYPE_BF16);
            pd_attention_params p = {.q = q, .k_cache = kd, .v_cache = vd, .out = out, .q_indptr = dev_i32(&c, c.gpu, qi, n + 1),
                                     .kv_lens = dev_i32(&c, c.gpu, kvl, n), .bt_indptr = dev_i32(&c, c.gpu, bti, n + 1),
                                     .bt_indices = dev_i32(&c, c.gpu, bt, n_bt), .token_seq = dev_i32(&c, c.gpu, qi, n),
                                     .n_tokens = n, .n_seqs = n, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                     .block_size = bsz, .q_stride = row, .max_q_len = 1, .max_kv_len = max_kv,
                                     .scale = 1.0f / sqrtf((float)hd), .n_new = way};
            pd_backend_sync(c.gpu);  // everything uploaded: the two ops run back to back
            pd_op_rope_kv(c.gpu, &r);
            pd_op_attention(c.gpu, &p);
            void *src[3] = {out, kd, vd};
            size_t cnt[3] = {no, kvn, kvn};
            for (int k = 0; k < 3; k++) {
                res[way][k] = pd_malloc(cnt[k] * 2);
                pd_backend_download(c.gpu, res[way][k], src[k], cnt[k] * 2);
            }
        }
        static const char *what[3] = {"outputs", "k cache", "v cache"};
        for (int k = 0; k < 3; k++) {
            size_t cnt = k ? kvn : no, diff = 0;
            for (size_t i = 0; i < cnt; i++) diff += res[1][k][i] != res[0][k][i];
            PD_CHECK_MSG(diff == 0, "attention decode, K/V loaded early (H=%d Hkv=%d hd=%d seqs=%d): %zu of %zu %s differ from n_new = 0",
                         H, Hkv, hd, n, diff, cnt, what[k]);
        }
        for (int way = 0; way < 2; way++)
            for (int k = 0; k < 3; k++) pd_free(res[way][k]);
        pd_free(bt), pd_free(qkv), pd_free(kc), pd_free(vc);
        ctx_release(&c);
    }
    ctx_fini(&c);
}

// Long contexts and batches of them at the decode kernels' partition boundaries, bf16 and fp8
// caches (GPU vs CPU; the cost of fp8 itself is checked on the short cases above): one stream at
// 32k (one-wave split into the most partitions, in-place merge), batches of long odd lengths
// (4-warp blocks, combine kernel; the Llama-3-8B heads at an eighth of the lengths), and cases with
// per-token V scales up to 2^±20 apart, K scales 2^±2, and all-zero V rows (the fp8 kernel's
// weighting frame). Few kv heads at the longest lengths: the CPU reference and the random fill
// dominate the test's time.
PD_TEST(test_cuda_attention_decode_long) {
    ctx c;
    if (!ctx_init(&c, 11)) PD_SKIP("%s: no CUDA device", __func__);
    int lens[9] = {8191, 1, 4099, 12345, 33, 8192, 16, 6001, 17};
    attn_case one = {.H = 8, .Hkv = 1, .hd = 128, .bs = 16, .n_seqs = 1, .q_lens = {1}, .kv_lens = {32768}};
    attn_check_gpu(&c, &one, "decode x1 32k");
    attn_case sp1 = {.H = 16, .Hkv = 2, .hd = 64, .bs = 16, .n_seqs = 1, .q_lens = {1}, .kv_lens = {20001}, .spread = 20};
    attn_check_gpu(&c, &sp1, "decode x1 spread scales");
    int cfg[][5] = {{8, 1, 128, 2, 12}, {16, 2, 64, 2, 0}, {32, 8, 128, 8, 12}};  // H, Hkv, hd, length divisor, spread
    for (size_t ci = 0; ci < PD_ARRAY_LEN(cfg); ci++) {
        attn_case b = {.H = cfg[ci][0], .Hkv = cfg[ci][1], .hd = cfg[ci][2], .bs = 16, .n_seqs = 9,
                       .q_lens = {1, 1, 1, 1, 1, 1, 1, 1, 1}, .spread = cfg[ci][4]};
        for (int i = 0; i < 9; i++) b.kv_lens[i] = lens[i] / cfg[ci][3] > 0 ? lens[i] / cfg[ci][3] : 1;
        attn_check_gpu(&c, &b, b.spread ? "decode x9 long, spread scales" : "decode x9 long");
    }
    ctx_fini(&c);
}

PD_TEST(test_cuda_attention_prefill_mixed) {
    ctx c;
    if (!ctx_init(&c, 8)) PD_SKIP("%s: no CUDA device", __func__);
    int heads[][2] = {{4, 4}, {8, 2}, {16, 2}};
    int hds[] = {64, 128, 32}, bss[] = {16, 1, 32, 5};
    for (size_t hi = 0; hi < PD_ARRAY_LEN(heads); hi++)
        for (size_t di = 0; di < PD_ARRAY_LEN(hds); di++) {
            int bs = bss[(hi * 3 + di) % 4];
            // one fresh prompt
            attn_case a = {.H = heads[hi][0], .Hkv = heads[hi][1], .hd = hds[di], .bs = bs, .n_seqs = 1,
                           .q_lens = {97}, .kv_lens = {97}};
            attn_check_both(&c, &a, "prefill 97");
            // prompts of odd lengths, some with cached prefixes (q_len < kv_len)
            attn_case b = {.H = heads[hi][0], .Hkv = heads[hi][1], .hd = hds[di], .bs = bs, .n_seqs = 4,
                           .q_lens = {54, 2, 130, 64}, .kv_lens = {54, 97, 300, 64 + 32}};
            attn_check_both(&c, &b, "prefill prefix");
            // mixed: decodes and prefill chunks together
            attn_case m = {.H = heads[hi][0], .Hkv = heads[hi][1], .hd = hds[di], .bs = bs, .n_seqs = 6,
                           .q_lens = {1, 77, 1, 1, 200, 3}, .kv_lens = {2047, 77, 1, 54, 700, 3}};
            attn_check_both(&c, &m, "mixed");
        }
    attn_case big = {.H = 8, .Hkv = 1, .hd = 128, .bs = 16, .n_seqs = 2, .q_lens = {1000, 1}, .kv_lens = {2047, 5000}};
    attn_check_both(&c, &big, "long prefill chunk");
    ctx_fini(&c);
}

// The prefill kernels' tiling (128 query rows, 64/128 K/V positions per tile, the causal diagonal,
// pages gathered into tiles): long prompts, several query tiles per sequence, chunks after a cached
// prefix, lengths that are not multiples of any tile or page, a batch of several prefills with a
// decode among them, head_dim 64 and 128.
PD_TEST(test_cuda_attention_prefill_tiles) {
    ctx c;
    if (!ctx_init(&c, 9)) PD_SKIP("%s: no CUDA device", __func__);
    int hds[] = {128, 64}, bss[] = {16, 3};
    for (size_t di = 0; di < PD_ARRAY_LEN(hds); di++) {
        attn_case a = {.H = 4, .Hkv = 1, .hd = hds[di], .bs = 16, .n_seqs = 1, .q_lens = {1531}, .kv_lens = {1531}};
        attn_check_both(&c, &a, "long prefill 1531");
        for (size_t bi = 0; bi < PD_ARRAY_LEN(bss); bi++) {
            attn_case m = {.H = 8, .Hkv = 2, .hd = hds[di], .bs = bss[bi], .n_seqs = 5,
                           .q_lens = {300, 129, 1, 513, 127}, .kv_lens = {300, 1000, 40, 2001, 127}};
            attn_check_both(&c, &m, "prefill batch with prefixes");
        }
        attn_case ch = {.H = 8, .Hkv = 8, .hd = hds[di], .bs = 16, .n_seqs = 2, .q_lens = {256, 255},
                        .kv_lens = {256 + 768, 255 + 129}};
        attn_check_both(&c, &ch, "chunked prefill after prefix");
    }
    ctx_fini(&c);
}

// ---- copy_blocks -------------------------------------------------------------------------------

PD_TEST(test_cuda_copy_blocks) {
    ctx c;
    if (!ctx_init(&c, 9)) PD_SKIP("%s: no CUDA device", __func__);
    int n_layers = 3, n_blocks = 10, block_elems = 16 * 2 * 64;
    size_t n = (size_t)n_blocks * block_elems;
    pd_backend *bs[2] = {c.cpu, c.gpu};
    void *caches[2][6];
    for (int k = 0; k < 2; k++) {
        for (int l = 0; l < 2 * n_layers; l++) {
            float *h = rand_f32(&c, n, 1.0f);
            caches[k][l] = dev_act(&c, bs[k], h, n);
            pd_free(h);
        }
        // same contents on both backends: reseed per backend
        pd_rng_seed(&c.rng, 9);
    }
    int32_t src[3] = {1, 4, 7}, dst[3] = {2, 9, 0};
    for (int k = 0; k < 2; k++) {
        void *kcs[3], *vcs[3];
        for (int l = 0; l < n_layers; l++) {
            kcs[l] = caches[k][2 * l];
            vcs[l] = caches[k][2 * l + 1];
        }
        pd_copy_blocks_params p = {.k_caches = kcs, .v_caches = vcs, .src_blocks = src, .dst_blocks = dst, .n = 3,
                                   .n_layers = n_layers,
                                   .block_bytes = (size_t)block_elems * pd_dtype_size(pd_backend_act_dtype(bs[k]))};
        pd_op_copy_blocks(bs[k], &p);
    }
    for (int l = 0; l < 2 * n_layers; l++) compare(&c, caches[1][l], caches[0][l], n, false, 0.0, "copy_blocks");
    ctx_fini(&c);
}

// ---- KV handoff: kv_copy, kv_checksum, CUDA IPC ------------------------------------------------

// Raw bytes on backend b (the KV handoff ops move and hash bytes, whatever the dtype).
static void *dev_bytes(ctx *c, pd_backend *b, const uint8_t *h, size_t n) {
    pd_buffer *buf = pd_buffer_alloc(b, n);
    PD_ASSERT(buf && c->n_bufs < MAX_BUFS);
    c->bufs[c->n_bufs++] = buf;
    pd_backend_upload(b, pd_buffer_ptr(buf), h, n);
    pd_backend_sync(b);
    return pd_buffer_ptr(buf);
}

static uint8_t *rand_bytes(ctx *c, size_t n, uint8_t fill, bool random) {
    uint8_t *h = pd_malloc(n);
    for (size_t i = 0; i < n; i++) h[i] = random ? (uint8_t)(pd_rng_next(&c->rng) >> 24) : fill;
    return h;
}

typedef struct kv_case {
    int n_layers, n_blocks, bs, layer_begin, layer_end, nb;
    size_t row_bytes;
    int32_t src[8], dst[8], rows[8];
} kv_case;

static const kv_case KV_CASES[] = {
    // Llama-3-8B rows (8 heads x 128 bf16 = 2 KiB): 32 KiB blocks span two kernel chunks.
    {3, 12, 16, 1, 3, 4, 2048, {3, 7, 1, 10}, {0, 5, 11, 2}, {16, 16, 16, 9}},
    // 24-byte rows (8-byte vector path), odd block size, one row in the last block.
    {2, 9, 5, 0, 2, 3, 24, {8, 0, 4}, {1, 2, 3}, {5, 5, 1}},
    // a single block, every layer
    {4, 3, 1, 0, 4, 1, 128, {2}, {0}, {1}},
};

PD_TEST(test_cuda_kv_copy) {
    ctx c;
    if (!ctx_init(&c, 21)) PD_SKIP("%s: no CUDA device", __func__);
    for (size_t ci = 0; ci < PD_ARRAY_LEN(KV_CASES); ci++) {
        const kv_case *k = &KV_CASES[ci];
        size_t layer = (size_t)k->n_blocks * (size_t)k->bs * k->row_bytes, bb = (size_t)k->bs * k->row_bytes;
        uint8_t *hs[2][8], *hd[2][8];
        void *ds[2][8], *dd[2][8];
        for (int l = 0; l < k->n_layers; l++)
            for (int kv = 0; kv < 2; kv++) {
                hs[kv][l] = rand_bytes(&c, layer, 0, true);
                hd[kv][l] = rand_bytes(&c, layer, 0xab, false);
                ds[kv][l] = dev_bytes(&c, c.gpu, hs[kv][l], layer);
                dd[kv][l] = dev_bytes(&c, c.gpu, hd[kv][l], layer);
            }
        pd_kv_copy_params p = {.src_k = ds[0], .src_v = ds[1], .dst_k = dd[0], .dst_v = dd[1], .src_blocks = k->src,
                               .dst_blocks = k->dst, .n_rows = k->rows, .n_blocks = k->nb, .layer_begin = k->layer_begin,
                               .layer_end = k->layer_end, .block_size = k->bs, .row_bytes = k->row_bytes};
        pd_op_kv_copy(c.gpu, &p);
        pd_backend_sync(c.gpu);
        uint8_t *got = pd_malloc(layer);
        for (int l = 0; l < k->n_layers; l++)
            for (int kv = 0; kv < 2; kv++) {
                // expected: the destination as it was, plus the listed rows of listed layers
                if (l >= k->layer_begin && l < k->layer_end)
                    for (int i = 0; i < k->nb; i++)
                        memcpy(hd[kv][l] + (size_t)k->dst[i] * bb, hs[kv][l] + (size_t)k->src[i] * bb,
                               (size_t)k->rows[i] * k->row_bytes);
                pd_backend_download(c.gpu, got, dd[kv][l], layer);
                PD_CHECK_MSG(!memcmp(got, hd[kv][l], layer), "kv_copy case %zu layer %d %s differs", ci, l, kv ? "V" : "K");
                pd_free(hs[kv][l]);
                pd_free(hd[kv][l]);
            }
        pd_free(got);
        ctx_release(&c);
    }
    ctx_fini(&c);
}

// GPU and CPU checksums of the same bytes agree bit for bit, and both equal base/checksum.h's
// definition computed here directly; one flipped bit changes the GPU sum.
PD_TEST(test_cuda_kv_checksum) {
    ctx c;
    if (!ctx_init(&c, 22)) PD_SKIP("%s: no CUDA device", __func__);
    for (size_t ci = 0; ci < PD_ARRAY_LEN(KV_CASES); ci++) {
        const kv_case *k = &KV_CASES[ci];
        size_t layer = (size_t)k->n_blocks * (size_t)k->bs * k->row_bytes, bb = (size_t)k->bs * k->row_bytes;
        uint8_t *h[2][8];
        void *dg[2][8], *dc[2][8];
        for (int l = 0; l < k->n_layers; l++)
            for (int kv = 0; kv < 2; kv++) {
                h[kv][l] = rand_bytes(&c, layer, 0, true);
                dg[kv][l] = dev_bytes(&c, c.gpu, h[kv][l], layer);
                dc[kv][l] = dev_bytes(&c, c.cpu, h[kv][l], layer);
            }
        uint64_t sg[8] = {0}, sc[8] = {0};
        pd_kv_checksum_params p = {.k = dg[0], .v = dg[1], .blocks = k->src, .n_rows = k->rows, .n_blocks = k->nb,
                                   .layer_begin = k->layer_begin, .layer_end = k->layer_end, .block_size = k->bs,
                                   .row_bytes = k->row_bytes, .sums = sg};
        pd_op_kv_checksum(c.gpu, &p);
        p.k = dc[0], p.v = dc[1], p.sums = sc;
        pd_op_kv_checksum(c.cpu, &p);
        for (int l = k->layer_begin; l < k->layer_end; l++) {
            uint64_t want = 0, g = 0;
            for (int kv = 0; kv < 2; kv++)
                for (int i = 0; i < k->nb; i++)
                    pd_checksum_run(&want, &g, h[kv][l] + (size_t)k->src[i] * bb, (size_t)k->rows[i] * k->row_bytes);
            int j = l - k->layer_begin;
            PD_CHECK_MSG(sg[j] == want && sc[j] == want, "case %zu layer %d: gpu %016llx cpu %016llx want %016llx", ci, l,
                         (unsigned long long)sg[j], (unsigned long long)sc[j], (unsigned long long)want);
        }
        // flip one bit in the last listed row of V of the last layer
        int l = k->layer_end - 1, i = k->nb - 1;
        size_t at = (size_t)k->src[i] * bb + (size_t)k->rows[i] * k->row_bytes - 3;
        uint8_t x = h[1][l][at] ^ 0x10;
        pd_backend_upload(c.gpu, (char *)dg[1][l] + at, &x, 1);
        uint64_t s2[8] = {0};
        p.k = dg[0], p.v = dg[1], p.sums = s2;
        pd_op_kv_checksum(c.gpu, &p);
        PD_CHECK(s2[l - k->layer_begin] != sg[l - k->layer_begin]);
        for (int ll = k->layer_begin; ll < l; ll++) PD_CHECK_EQ(s2[ll - k->layer_begin], sg[ll - k->layer_begin]);
        for (int ll = 0; ll < k->n_layers; ll++) pd_free(h[0][ll]), pd_free(h[1][ll]);
        ctx_release(&c);
    }
    ctx_fini(&c);
}

// The transfer stream (pd_backend_xfer_mark, pd_op_kv_copy_xfer, pd_op_kv_checksum_xfer): the
// sources are written on the compute stream without a sync, then each listed layer is copied and
// checksummed on the transfer stream after a mark; after pd_backend_xfer_sync the destination and
// the sums are exactly what the compute-stream writes give (the mark orders them).
PD_TEST(test_cuda_kv_xfer_stream) {
    ctx c;
    if (!ctx_init(&c, 24)) PD_SKIP("%s: no CUDA device", __func__);
    PD_CHECK(pd_backend_has_xfer_stream(c.gpu));
    PD_CHECK(!pd_backend_has_xfer_stream(c.cpu));
    for (size_t ci = 0; ci < PD_ARRAY_LEN(KV_CASES); ci++) {
        const kv_case *k = &KV_CASES[ci];
        size_t layer = (size_t)k->n_blocks * (size_t)k->bs * k->row_bytes, bb = (size_t)k->bs * k->row_bytes;
        uint8_t *hs[2][8], *hd[2][8], *stale = rand_bytes(&c, layer, 0x5a, false);
        void *ds[2][8], *dd[2][8];
        for (int l = 0; l < k->n_layers; l++)
            for (int kv = 0; kv < 2; kv++) {
                hs[kv][l] = rand_bytes(&c, layer, 0, true);
                hd[kv][l] = rand_bytes(&c, layer, 0xab, false);
                ds[kv][l] = dev_bytes(&c, c.gpu, stale, layer);  // synced: what a missing dependency would read
                dd[kv][l] = dev_bytes(&c, c.gpu, hd[kv][l], layer);
            }
        uint64_t sums[8] = {0};
        for (int l = k->layer_begin; l < k->layer_end; l++) {
            for (int kv = 0; kv < 2; kv++) pd_backend_upload(c.gpu, ds[kv][l], hs[kv][l], layer);  // compute stream
            pd_backend_xfer_mark(c.gpu);
            pd_kv_copy_params p = {.src_k = ds[0], .src_v = ds[1], .dst_k = dd[0], .dst_v = dd[1], .src_blocks = k->src,
                                   .dst_blocks = k->dst, .n_rows = k->rows, .n_blocks = k->nb, .layer_begin = l,
                                   .layer_end = l + 1, .block_size = k->bs, .row_bytes = k->row_bytes};
            pd_op_kv_copy_xfer(c.gpu, &p);
            pd_kv_checksum_params cp = {.k = ds[0], .v = ds[1], .blocks = k->src, .n_rows = k->rows, .n_blocks = k->nb,
                                        .layer_begin = l, .layer_end = l + 1, .block_size = k->bs,
                                        .row_bytes = k->row_bytes, .sums = sums + l};
            pd_op_kv_checksum_xfer(c.gpu, &cp);
        }
        pd_backend_xfer_sync(c.gpu);
        pd_backend_sync(c.gpu);
        uint8_t *got = pd_malloc(layer);
        for (int l = 0; l < k->n_layers; l++) {
            bool listed = l >= k->layer_begin && l < k->layer_end;
            uint64_t want = 0, g = 0;
            for (int kv = 0; kv < 2; kv++) {
                if (listed)
                    for (int i = 0; i < k->nb; i++) {
                        memcpy(hd[kv][l] + (size_t)k->dst[i] * bb, hs[kv][l] + (size_t)k->src[i] * bb,
                               (size_t)k->rows[i] * k->row_bytes);
                        pd_checksum_run(&want, &g, hs[kv][l] + (size_t)k->src[i] * bb, (size_t)k->rows[i] * k->row_bytes);
                    }
                pd_backend_download(c.gpu, got, dd[kv][l], layer);
                PD_CHECK_MSG(!memcmp(got, hd[kv][l], layer), "xfer case %zu layer %d %s differs", ci, l, kv ? "V" : "K");
                pd_free(hs[kv][l]);
                pd_free(hd[kv][l]);
            }
            if (listed)
                PD_CHECK_MSG(sums[l] == want, "xfer case %zu layer %d: sum %016llx want %016llx", ci, l,
                             (unsigned long long)sums[l], (unsigned long long)want);
        }
        pd_free(got);
        pd_free(stale);
        ctx_release(&c);
    }
    ctx_fini(&c);
}

// The transfer stream with host memory on one side (the KV tiers' pinned DRAM pages): pinned
// host -> device, then device -> pinned host, for each PD_CUDA_KV_DMA mode (0, the default: the
// kv_copy kernel; 1: the copy engines for these copies; 2: the copy engines for every copy; and
// the kernel with one CTA a chunk, capped at 2 CTAs and at the default 16, PD_CUDA_KV_COPY_CTAS).
// Extra cases put runs of blocks contiguous on both sides (merged into one copy per layer and
// K/V) next to breaks of the run: a partial block inside, an index step on one side only.
PD_TEST(test_cuda_kv_xfer_host) {
    static const kv_case RUNS[] = {
        {2, 12, 16, 0, 2, 6, 2048, {2, 3, 4, 7, 8, 11}, {5, 6, 7, 0, 9, 10}, {16, 16, 16, 16, 7, 16}},
        {3, 10, 4, 1, 3, 5, 24, {0, 1, 2, 3, 9}, {4, 5, 6, 7, 0}, {4, 4, 2, 4, 3}},
    };
    // Modes 0 and 3-4: the kernel with one CTA a chunk (PD_CUDA_KV_COPY_CTAS=0), capped at 2 CTAs
    // striding over every copy, and at the default cap (16).
    for (int mode = 0; mode <= 4; mode++) {
        char mv[2] = {(char)('0' + (mode >= 3 ? 0 : mode)), 0};
        setenv("PD_CUDA_KV_DMA", mv, 1);
        if (mode == 0 || mode == 3) setenv("PD_CUDA_KV_COPY_CTAS", mode == 3 ? "2" : "0", 1);
        else unsetenv("PD_CUDA_KV_COPY_CTAS");
        ctx c;
        if (!ctx_init(&c, 25)) {
            unsetenv("PD_CUDA_KV_DMA");
            unsetenv("PD_CUDA_KV_COPY_CTAS");
            PD_SKIP("%s: no CUDA device", __func__);
        }
        for (size_t ci = 0; ci < PD_ARRAY_LEN(KV_CASES) + PD_ARRAY_LEN(RUNS); ci++) {
            const kv_case *k = ci < PD_ARRAY_LEN(KV_CASES) ? &KV_CASES[ci] : &RUNS[ci - PD_ARRAY_LEN(KV_CASES)];
            size_t layer = (size_t)k->n_blocks * (size_t)k->bs * k->row_bytes, bb = (size_t)k->bs * k->row_bytes;
            void *hs[2][8], *hb[2][8], *dd[2][8];
            uint8_t *want[2][8], *want_back[2][8];
            for (int l = 0; l < k->n_layers; l++)
                for (int kv = 0; kv < 2; kv++) {
                    uint8_t *src = rand_bytes(&c, layer, 0, true), *dst = rand_bytes(&c, layer, 0, true);
                    hs[kv][l] = pd_backend_host_alloc(c.gpu, layer);
                    hb[kv][l] = pd_backend_host_alloc(c.gpu, layer);
                    PD_REQUIRE(hs[kv][l] && hb[kv][l]);
                    memcpy(hs[kv][l], src, layer);
                    memset(hb[kv][l], 0x3c, layer);
                    dd[kv][l] = dev_bytes(&c, c.gpu, dst, layer);
                    want[kv][l] = dst;  // the device rows after the load
                    want_back[kv][l] = pd_malloc(layer);
                    memset(want_back[kv][l], 0x3c, layer);
                    if (l >= k->layer_begin && l < k->layer_end)
                        for (int i = 0; i < k->nb; i++)
                            memcpy(dst + (size_t)k->dst[i] * bb, src + (size_t)k->src[i] * bb,
                                   (size_t)k->rows[i] * k->row_bytes);
                    pd_free(src);
                }
            // the save: the same listed rows back from the device into the second host set
            for (int l = k->layer_begin; l < k->layer_end; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (int i = 0; i < k->nb; i++)
                        memcpy(want_back[kv][l] + (size_t)k->src[i] * bb, want[kv][l] + (size_t)k->dst[i] * bb,
                               (size_t)k->rows[i] * k->row_bytes);
            pd_backend_xfer_mark(c.gpu);
            pd_kv_copy_params p = {.src_k = hs[0], .src_v = hs[1], .dst_k = dd[0], .dst_v = dd[1], .src_blocks = k->src,
                                   .dst_blocks = k->dst, .n_rows = k->rows, .n_blocks = k->nb,
                                   .layer_begin = k->layer_begin, .layer_end = k->layer_end, .block_size = k->bs,
                                   .row_bytes = k->row_bytes};
            pd_op_kv_copy_xfer(c.gpu, &p);
            pd_kv_copy_params back = p;
            back.src_k = dd[0], back.src_v = dd[1], back.dst_k = hb[0], back.dst_v = hb[1];
            back.src_blocks = k->dst, back.dst_blocks = k->src;
            pd_op_kv_copy_xfer(c.gpu, &back);
            pd_backend_xfer_sync(c.gpu);
            pd_backend_sync(c.gpu);
            uint8_t *got = pd_malloc(layer);
            for (int l = 0; l < k->n_layers; l++)
                for (int kv = 0; kv < 2; kv++) {
                    pd_backend_download(c.gpu, got, dd[kv][l], layer);
                    PD_CHECK_MSG(!memcmp(got, want[kv][l], layer), "dma %d case %zu layer %d %s: load differs", mode, ci,
                                 l, kv ? "V" : "K");
                    PD_CHECK_MSG(!memcmp(hb[kv][l], want_back[kv][l], layer), "dma %d case %zu layer %d %s: save differs",
                                 mode, ci, l, kv ? "V" : "K");
                    pd_backend_host_free(c.gpu, hs[kv][l]);
                    pd_backend_host_free(c.gpu, hb[kv][l]);
                    pd_free(want[kv][l]);
                    pd_free(want_back[kv][l]);
                }
            pd_free(got);
            ctx_release(&c);
        }
        ctx_fini(&c);
    }
    unsetenv("PD_CUDA_KV_DMA");
    unsetenv("PD_CUDA_KV_COPY_CTAS");
}

// An exported pool describes itself; opening our own handle fails cleanly (CUDA IPC handles can
// only be opened by another process — bench-handoff exercises that path across two GPUs).
PD_TEST(test_cuda_ipc_export) {
    ctx c;
    if (!ctx_init(&c, 23)) PD_SKIP("%s: no CUDA device", __func__);
    pd_err err = {0};
    pd_buffer *buf = pd_buffer_alloc_shared(c.gpu, 1 << 20, &err);
    PD_REQUIRE(buf);
    pd_buffer_handle h;
    PD_CHECK_EQ(pd_buffer_export(buf, &h), PD_OK);
    PD_CHECK_STR(h.kind, "cuda");
    PD_CHECK_EQ((long long)h.n_bytes, 1 << 20);
    PD_CHECK_EQ(h.pid, (int32_t)getpid());
    PD_CHECK_EQ(h.device, 0);
    pd_err e2 = {0};
    void *p = pd_backend_import(c.gpu, &h, &e2);
    PD_CHECK(p == NULL);
    PD_CHECK(e2.status != PD_OK);
    pd_buffer_handle bad = h;
    snprintf(bad.kind, sizeof bad.kind, "shm");
    bad.pid = 1;
    PD_CHECK(pd_backend_import(c.gpu, &bad, &e2) == NULL);
    // the shared buffer works like any other
    uint8_t in[64], out[64];
    for (int i = 0; i < 64; i++) in[i] = (uint8_t)(i * 7 + 1);
    pd_backend_upload(c.gpu, pd_buffer_ptr(buf), in, 64);
    pd_backend_download(c.gpu, out, pd_buffer_ptr(buf), 64);
    PD_CHECK(!memcmp(in, out, 64));
    pd_buffer_free(buf);
    ctx_fini(&c);
}

// ---- CPU-only: the paged layout does not change attention -------------------------------------

// The same logical K/V under different block sizes and page permutations gives bit-identical
// CPU results (the reference the CUDA tests rely on reads pages correctly).
PD_TEST(test_cpu_attention_paging_invariance) {
    ctx c;
    memset(&c, 0, sizeof c);
    c.cpu = pd_backend_cpu_new(0);
    attn_case a = {.H = 4, .Hkv = 2, .hd = 32, .bs = 16, .n_seqs = 3, .q_lens = {1, 9, 30}, .kv_lens = {40, 20, 30}};
    int bss[] = {1, 3, 32};
    int n_tok = 0;
    void *ref = attn_run(&c, c.cpu, &a, 5, &n_tok);
    float *hr = to_host(c.cpu, ref, (size_t)n_tok * 128, PD_DTYPE_F32);
    for (size_t i = 0; i < PD_ARRAY_LEN(bss); i++) {
        attn_case b = a;
        b.bs = bss[i];
        void *x = attn_run(&c, c.cpu, &b, 5, &n_tok);
        float *hx = to_host(c.cpu, x, (size_t)n_tok * 128, PD_DTYPE_F32);
        PD_CHECK_MSG(nmse(hx, hr, (size_t)n_tok * 128) < 1e-12, "bs=%d changes the result", bss[i]);
        pd_free(hx);
    }
    pd_free(hr);
    ctx_release(&c);
    pd_backend_free(c.cpu);
}

// ---- sampling on the device (pd_op_sample) vs the CPU sampler ----------------------------------
#include "model/sample.h"  // the CPU sampler is the reference

// Twin samplers (same parameters, seed and history) sample the same logits, one through
// pd_sampler_sample, one through the CUDA op (export_row → pd_op_sample → import_result, as the
// engine does). Greedy and seeded draws must give the same token, logprobs agree within 1e-4 and
// the top-N ids are equal. Row configurations cycle through greedy, temperature, top-k, top-p,
// min-p, all of them together, penalties and logprobs; half the cases round the logits to bf16,
// which makes exact ties common (greedy ties, top-k / top-p cuts inside a run of equal values).
// Every third row also has logit biases (including -100 bans) and every sixth a token mask: the
// drawn token is never banned or masked, on either side.
#define N_SAMPLE_CFG 12
static pd_sampling_params sample_cfg(int k, uint64_t seed) {
    pd_sampling_params p = pd_sampling_params_default();
    p.seed = seed, p.has_seed = true;
    switch (k) {
    case 0: p.temperature = 0; break;
    case 1: p.temperature = 0.8f; break;
    case 2: p.top_k = 50; break;
    case 3: p.top_p = 0.9f; break;
    case 4: p.temperature = 0.7f, p.min_p = 0.1f; break;
    case 5: p.temperature = 1.2f, p.top_k = 100, p.top_p = 0.8f, p.min_p = 0.02f; break;
    case 6: p.temperature = 0, p.presence_penalty = 0.5f, p.frequency_penalty = 0.3f, p.repetition_penalty = 1.2f,
            p.n_logprobs = 5; break;
    case 7: p.repetition_penalty = 1.3f, p.presence_penalty = -0.5f, p.frequency_penalty = 0.4f, p.top_p = 0.95f,
            p.n_logprobs = 20; break;
    case 8: p.temperature = 0.9f, p.n_logprobs = 0; break;
    // more top-k candidates than the device's candidate set holds, and a flat row whose top-p
    // boundary bin overflows it: both take the radix passes (src/kernels/sample.cu)
    case 10: p.top_k = 3000, p.top_p = 0.97f; break;
    case 11: p.temperature = 8.0f, p.top_p = 0.9f; break;
    // beyond N_SAMPLE_CFG (the distribution cases below name them): top-p alone, with min-p, colder
    case 12: p.top_p = 0.95f; break;
    case 13: p.top_p = 0.9f, p.min_p = 0.05f; break;
    case 14: p.temperature = 0.6f, p.top_p = 0.5f; break;
    default: p.top_k = 1, p.temperature = 1.5f; break;
    }
    return p;
}

typedef struct sample_bufs {
    pd_sample_row *rows;
    pd_sample_pen *pens;
    pd_sample_out *outs;
    int cap_pens;
    uint32_t *masks;
    int cap_masks;
} sample_bufs;

// A fixed token mask (the grammar's place in these tests): about half the vocabulary allowed.
typedef struct test_mask {
    uint32_t *bits;
    int words;
} test_mask;
static int test_mask_fill(void *ud, uint32_t *m) {
    test_mask *t = ud;
    memcpy(m, t->bits, sizeof(uint32_t) * (size_t)t->words);
    return 1;
}
static pd_status test_mask_accept(void *ud, int32_t tok) {  // the histories below are random
    PD_UNUSED(ud);
    PD_UNUSED(tok);
    return PD_OK;
}
static void test_mask_free(void *ud) {
    test_mask *t = ud;
    pd_free(t->bits);
    pd_free(t);
}
static const pd_token_mask_ops k_test_mask_ops = {test_mask_fill, test_mask_accept, test_mask_free};

// A ctl with logit biases (one -100 ban among them) and, when with_mask, a mask from seed.
static pd_sample_ctl *test_ctl(int V, uint64_t seed, bool with_mask) {
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    pd_sample_ctl *c = pd_calloc(1, sizeof *c);
    c->bias = pd_malloc(sizeof(pd_logit_bias) * 6);
    static const float biases[] = {-100.0f, 3.0f, -2.5f, 8.0f, -100.0f, 0.5f};
    for (int i = 0; i < 6; i++) {
        int32_t t = (int32_t)(pd_rng_next(&rng) % 40);  // small ids: they collide with penalty entries
        bool dup = false;
        for (int j = 0; j < c->n_bias; j++) dup |= c->bias[j].token == t;
        if (!dup) c->bias[c->n_bias++] = (pd_logit_bias){t, biases[i]};
    }
    if (with_mask) {
        test_mask *m = pd_calloc(1, sizeof *m);
        m->words = (V + 31) / 32;
        m->bits = pd_malloc(sizeof(uint32_t) * (size_t)m->words);
        for (int w = 0; w < m->words; w++) m->bits[w] = (uint32_t)pd_rng_next(&rng);
        c->mask_ops = &k_test_mask_ops;
        c->mask_ud = m;
    }
    return c;
}

static bool banned_or_masked(const pd_sample_ctl *c, int32_t t) {
    for (int i = 0; c && i < c->n_bias; i++)
        if (c->bias[i].token == t && c->bias[i].bias <= PD_SAMPLE_BIAS_BAN) return true;
    if (c && c->mask_ops) {
        const test_mask *m = c->mask_ud;
        return !((m->bits[t >> 5] >> (t & 31)) & 1);
    }
    return false;
}

// Exports every GPU-side sampler, runs the op on dev (n_rows, V).
static void sample_on_gpu(ctx *c, pd_sampler **s, int n_rows, int V, float *dev, sample_bufs *sb) {
    int n = 0;
    for (int r = 0; r < n_rows; r++) n += pd_sampler_n_pens(s[r]);
    if (n > sb->cap_pens) {
        pd_free(sb->pens);
        sb->pens = pd_malloc(sizeof(pd_sample_pen) * (size_t)n);
        sb->cap_pens = n;
    }
    int words = (V + 31) / 32;
    if (n_rows * words > sb->cap_masks) {
        pd_free(sb->masks);
        sb->masks = pd_malloc(sizeof(uint32_t) * (size_t)n_rows * (size_t)words);
        sb->cap_masks = n_rows * words;
    }
    int off = 0, n_masks = 0;
    for (int r = 0; r < n_rows; r++) {
        pd_sampler_export_row(s[r], off, &sb->rows[r], sb->pens + off);
        off += sb->rows[r].n_pens;
        if (pd_sampler_has_mask(s[r])) {
            pd_sampler_fill_mask(s[r], sb->masks + (size_t)n_masks * (size_t)words);
            sb->rows[r].mask_row = n_masks++;
        }
    }
    pd_sample_params sp = {.logits = dev, .n_rows = n_rows, .vocab = V, .rows = sb->rows, .pens = sb->pens,
                           .n_pens = off, .out = sb->outs, .masks = sb->masks, .n_masks = n_masks,
                           .mask_words = words};
    pd_op_sample(c->gpu, &sp);
}

// Row distributions of the sampler cases. The one-read top-p path and the candidate set take the
// boundary bin (1/64 of a logit) of the nucleus when it holds <= 1024 tokens and fall back to the
// radix passes otherwise: these rows put the cut inside runs of equal and one-ulp-apart values,
// make the nucleus most of the vocabulary, or one token.
enum {
    DIST_NORMAL,  // 3 * normal(0, 1)
    DIST_TIES,    // 3 * normal rounded to 1/8, half of them one ulp up: exact and near ties everywhere
    DIST_FLAT,    // 0.02 * normal: the nucleus holds about 90% of the vocabulary
    DIST_HEAD,    // one token with about half the mass, a nearly flat tail: the cut deep in the tail
    DIST_SPIKE,   // one token 40 above a normal row: a nucleus of one
};
static float dist_logit(ctx *c, int dist, size_t i, int V) {
    int id = (int)(i % (size_t)V);
    float v = pd_rng_normal(&c->rng);
    switch (dist) {
    case DIST_TIES: {
        float q = roundf(3.0f * v * 8.0f) / 8.0f;
        return pd_rng_next(&c->rng) & 1 ? nextafterf(q, INFINITY) : q;
    }
    case DIST_FLAT: return 0.02f * v;
    case DIST_HEAD: return id == 17 ? logf((float)V) : 0.01f * v;
    case DIST_SPIKE: return id == 5 ? 40.0f : 3.0f * v;
    default: return 3.0f * v;
    }
}

// cfgs (n_cfgs of them; NULL: every one of the first N_SAMPLE_CFG): row r takes cfgs[(r + cfg_off) % n_cfgs].
static void sample_case_ex(ctx *c, int V, int n_rows, bool bf16, int cfg_off, int n_steps, int dist, const int *cfgs,
                           int n_cfgs) {
    pd_sampler *cs[64], *gs[64];
    pd_sampling_params ps[64];
    pd_sample_ctl *ctls[64] = {0};
    PD_ASSERT(n_rows <= 64);
    for (int r = 0; r < n_rows; r++) {
        int k = cfgs ? cfgs[(r + cfg_off) % n_cfgs] : (r + cfg_off) % N_SAMPLE_CFG;
        ps[r] = sample_cfg(k, 1000003ull * (uint64_t)(r + 1) + (uint64_t)cfg_off);
        cs[r] = pd_sampler_new(&ps[r], V);
        gs[r] = pd_sampler_new(&ps[r], V);
        if (r % 3 == 1) {  // logit bias, and a token mask on every other such row
            uint64_t seed = 77 + (uint64_t)r;
            PD_CHECK(pd_sampler_set_ctl(cs[r], test_ctl(V, seed, r % 6 == 1)) == PD_OK);
            PD_CHECK(pd_sampler_set_ctl(gs[r], test_ctl(V, seed, r % 6 == 1)) == PD_OK);
            ctls[r] = test_ctl(V, seed, r % 6 == 1);  // the reference copy for the checks below
        }
        int n_prompt = 10 + (int)(pd_rng_next(&c->rng) % 60), n_gen = (int)(pd_rng_next(&c->rng) % 25);
        for (int i = 0; i < n_prompt + n_gen; i++) {
            // a small id range now and then, so that tokens repeat
            int32_t t = (int32_t)(pd_rng_next(&c->rng) % (uint64_t)(i % 3 ? V : 40));
            if (i < n_prompt) pd_sampler_add_prompt(cs[r], &t, 1), pd_sampler_add_prompt(gs[r], &t, 1);
            else pd_sampler_accept(cs[r], t), pd_sampler_accept(gs[r], t);
        }
    }
    size_t n = (size_t)n_rows * (size_t)V;
    float *h = pd_malloc(sizeof(float) * n), *back = pd_malloc(sizeof(float) * n), *row = pd_malloc(sizeof(float) * (size_t)V);
    pd_buffer *buf = pd_buffer_alloc(c->gpu, sizeof(float) * n);
    PD_ASSERT(buf);
    sample_bufs sb = {.rows = pd_malloc(sizeof(pd_sample_row) * (size_t)n_rows),
                      .outs = pd_malloc(sizeof(pd_sample_out) * (size_t)n_rows)};
    int n_bad = 0;
    for (int step = 0; step < n_steps; step++) {
        for (size_t i = 0; i < n; i++) {
            float v = dist_logit(c, dist, i, V);
            h[i] = bf16 ? pd_bf16_to_f32(pd_f32_to_bf16(v)) : v;
        }
        pd_backend_upload(c->gpu, pd_buffer_ptr(buf), h, sizeof(float) * n);
        sample_on_gpu(c, gs, n_rows, V, pd_buffer_ptr(buf), &sb);
        pd_backend_download(c->gpu, back, pd_buffer_ptr(buf), sizeof(float) * n);
        PD_CHECK_MSG(!memcmp(back, h, sizeof(float) * n), "V=%d rows=%d: the op left the logits changed", V, n_rows);
        for (int r = 0; r < n_rows; r++) {
            memcpy(row, h + (size_t)r * (size_t)V, sizeof(float) * (size_t)V);
            pd_sample_result rc, rg;
            int32_t tc = pd_sampler_sample(cs[r], row, &rc);
            int32_t tg = pd_sampler_import_result(gs[r], &sb.outs[r], &rg);
            pd_sampler_accept(cs[r], tc);
            pd_sampler_accept(gs[r], tg);
            const pd_sampling_params *p = &ps[r];
            PD_CHECK_MSG(!banned_or_masked(ctls[r], tc) && !banned_or_masked(ctls[r], tg),
                         "row %d drew a banned or masked token (cpu %d gpu %d)", r, tc, tg);
            if (tc != tg && n_bad++ < 8)
                PD_FAIL_("V=%d rows=%d bf16=%d dist %d step %d row %d (T=%g k=%d p=%g min_p=%g pen=%g/%g/%g): cpu %d gpu %d",
                         V, n_rows, bf16, dist, step, r, p->temperature, p->top_k, p->top_p, p->min_p, p->presence_penalty,
                         p->frequency_penalty, p->repetition_penalty, tc, tg);
            if (p->n_logprobs < 0) continue;
            PD_CHECK_NEAR(rg.logprob, rc.logprob, 1e-4);
            PD_CHECK_EQ(rg.n_top, rc.n_top);
            for (int j = 0; j < rc.n_top && j < rg.n_top; j++) {
                PD_CHECK_EQ(rg.top_ids[j], rc.top_ids[j]);
                PD_CHECK_NEAR(rg.top_logprobs[j], rc.top_logprobs[j], 1e-4);
            }
        }
    }
    PD_CHECK_MSG(n_bad == 0, "V=%d rows=%d bf16=%d dist %d: %d of %d tokens differ", V, n_rows, bf16, dist, n_bad,
                 n_rows * n_steps);
    for (int r = 0; r < n_rows; r++) pd_sampler_free(cs[r]), pd_sampler_free(gs[r]), pd_sample_ctl_free(ctls[r]);
    pd_buffer_free(buf);
    pd_free(h), pd_free(back), pd_free(row), pd_free(sb.rows), pd_free(sb.outs), pd_free(sb.pens), pd_free(sb.masks);
}

static void sample_case(ctx *c, int V, int n_rows, bool bf16, int cfg_off, int n_steps) {
    sample_case_ex(c, V, n_rows, bf16, cfg_off, n_steps, DIST_NORMAL, NULL, 0);
}

// Host-timed op calls (upload of the rows, kernel, download, sync) for 64 rows of V = 151936.
static void sample_timing(ctx *c) {
    int V = 151936, n_rows = 64;
    size_t n = (size_t)n_rows * (size_t)V;
    float *h = rand_f32(c, n, 3.0f);
    pd_buffer *buf = pd_buffer_alloc(c->gpu, sizeof(float) * n);
    PD_ASSERT(buf);
    pd_backend_upload(c->gpu, pd_buffer_ptr(buf), h, sizeof(float) * n);
    sample_bufs sb = {.rows = pd_malloc(sizeof(pd_sample_row) * (size_t)n_rows),
                      .outs = pd_malloc(sizeof(pd_sample_out) * (size_t)n_rows)};
    const char *names[] = {"greedy", "temperature 0.8", "top-k 50", "top-p 0.9", "min-p 0.1", "all four",
                           "penalties+logprobs 5", "penalties+top-p+logprobs 20"};
    printf("  pd_op_sample, %d rows x %d, H2D rows + kernel + D2H + sync, median of 15:\n", n_rows, V);
    for (int k = 0; k < 8; k++) {
        pd_sampler *s[64];
        pd_sampling_params p = sample_cfg(k, 7);
        for (int r = 0; r < n_rows; r++) {
            s[r] = pd_sampler_new(&p, V);
            for (int32_t t = 0; t < 200; t++) pd_sampler_accept(s[r], (t * 7919) % V);
        }
        double us[15];
        for (int it = 0; it < 17; it++) {
            int64_t t0 = pd_time_us();
            sample_on_gpu(c, s, n_rows, V, pd_buffer_ptr(buf), &sb);
            if (it >= 2) us[it - 2] = (double)(pd_time_us() - t0);
        }
        for (int a = 1; a < 15; a++)
            for (int b = a; b > 0 && us[b] < us[b - 1]; b--) {
                double t = us[b];
                us[b] = us[b - 1], us[b - 1] = t;
            }
        printf("    %-28s %8.1f us\n", names[k], us[7]);
        for (int r = 0; r < n_rows; r++) pd_sampler_free(s[r]);
    }
    pd_buffer_free(buf);
    pd_free(h), pd_free(sb.rows), pd_free(sb.outs), pd_free(sb.pens), pd_free(sb.masks);
}

PD_TEST(test_cuda_sample) {
    ctx c;
    if (!ctx_init(&c, 31)) PD_SKIP("%s: no CUDA device", __func__);
    PD_CHECK(pd_backend_has_sample(c.gpu));
    PD_CHECK(!pd_backend_has_sample(c.cpu));
    int vocabs[] = {32000, 151936}, rows[] = {1, 7, 64};
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < 3; r++)
            for (int bf = 0; bf < 2; bf++) sample_case(&c, vocabs[v], rows[r], bf, r * 3 + bf, rows[r] == 64 ? 2 : 4);
    // Small batches run a cluster of up to 16 CTAs per row: every configuration at batch 2 (row 1
    // with logit biases and a token mask) and at batch 8, for the vocabularies of Llama-2 (32000),
    // Llama-3 (128256) and Qwen2 (152064); then every cluster size forced (PD_CUDA_SAMPLE_CLUSTER).
    int big[] = {32000, 128256, 152064};
    for (int v = 0; v < 3; v++) {
        for (int k = 0; k < N_SAMPLE_CFG; k++) sample_case(&c, big[v], 2, (k + v) & 1, k, 2);
        sample_case(&c, big[v], 8, v & 1, v, 2);
    }
    static const char *cls[] = {"1", "2", "4", "8", "16"};
    for (int q = 0; q < 5; q++) {
        setenv("PD_CUDA_SAMPLE_CLUSTER", cls[q], 1);
        for (int k = 0; k < N_SAMPLE_CFG; k += 2) sample_case(&c, 128256, 3, (k / 2) & 1, k + q, 1);
    }
    unsetenv("PD_CUDA_SAMPLE_CLUSTER");
    // The radix passes alone (PD_CUDA_SAMPLE_FAST=0), the copies both ways instead of rows in the
    // launch's parameters and results written to mapped memory (PD_CUDA_SAMPLE_DIRECT=0), and a
    // stream synchronize instead of polling the mapped results (PD_CUDA_SAMPLE_POLL=0), and every
    // CTA of a cluster reading every bin of the others' histograms (PD_CUDA_SAMPLE_GATHER=0).
    static const char *knobs[][2] = {{"PD_CUDA_SAMPLE_FAST", "0"}, {"PD_CUDA_SAMPLE_DIRECT", "0"}, {"PD_CUDA_SAMPLE_POLL", "0"},
                                     {"PD_CUDA_SAMPLE_GATHER", "0"}};
    for (int q = 0; q < 4; q++) {
        setenv(knobs[q][0], knobs[q][1], 1);
        for (int k = 0; k < N_SAMPLE_CFG; k++) sample_case(&c, 128256, 2, k & 1, k + 7 * q, 1);
        sample_case(&c, 32000, 8, q, q, 1);
        unsetenv(knobs[q][0]);
    }
    // Top-p rows on hard distributions (ties, flat, head + flat tail, spike) at batch 1, 3 and 8 (one
    // cluster of 16 or 8 CTAs a row: the one-read top-p path), each with the one-read path off
    // (PD_CUDA_SAMPLE_TOPP2=0: the candidate-set path) and with every cluster size forced.
    static const int tp_cfgs[] = {3, 12, 13, 14, 5, 11, 1};
    int n_tp = (int)(sizeof tp_cfgs / sizeof tp_cfgs[0]);
    for (int q = 0; q < 2; q++) {
        if (q) setenv("PD_CUDA_SAMPLE_TOPP2", "0", 1);
        for (int d = 0; d <= DIST_SPIKE; d++)
            for (int v = 0; v < 3; v++) {
                for (int k = 0; k < n_tp; k++) sample_case_ex(&c, big[v], 1, (d + k) & 1 && d != DIST_FLAT, k, 1, d, tp_cfgs, n_tp);
                sample_case_ex(&c, big[v], 3, d & 1, d + v, 1, d, tp_cfgs, n_tp);
                sample_case_ex(&c, big[v], 8, 0, d, 1, d, tp_cfgs, n_tp);
            }
        unsetenv("PD_CUDA_SAMPLE_TOPP2");
    }
    for (int q = 0; q < 5; q++) {
        setenv("PD_CUDA_SAMPLE_CLUSTER", cls[q], 1);
        for (int d = 0; d <= DIST_SPIKE; d++) sample_case_ex(&c, 128256, n_tp, d & 1 && d != DIST_FLAT, q, 1, d, tp_cfgs, n_tp);
    }
    unsetenv("PD_CUDA_SAMPLE_CLUSTER");
    sample_timing(&c);
    ctx_fini(&c);
}
