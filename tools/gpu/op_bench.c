// op_bench — times the CUDA backend's ops on real model shapes (Llama-3-8B by default), through
// the public backend API only: decode GEMMs (skinny kernel vs cuBLASLt), prefill GEMMs, the
// 8192^3 GEMM peak, paged attention (prefill and decode) and a 1 GiB device copy. Host clock
// around N back-to-back launches followed by a sync; weights rotate over several copies so
// that L2 does not serve them (back-to-back launches overlap through PDL where the kernel uses
// it, as they do inside a decode step). Build: tools/gpu/build.sh; run on the GPU machine.
// sample: pd_op_sample (rows' parameters up, kernel, results down, sync: the whole op as the engine
// calls it) at batch 1 / 8 / 64 / 256 for three vocabularies and five configurations; the first
// line (V = 1024, greedy, batch 1) is the op's fixed cost.
// gemv: the decode GEMM shapes at M = 1..9, 12, 16: cuBLASLt (PD_CUDA_SKINNY=0), the row-streaming
// CUDA-core skinny kernel (PD_CUDA_SKINNY=2 PD_CUDA_SKINNY_MMA=0; M <= 8) and the tensor-core one
// (PD_CUDA_SKINNY_MMA=2) with 16 and 32 weight rows per block, single- and double-buffered
// (PD_CUDA_SKINNY_MMA_PIPE=1: mma16p, mma32p): time and weight bytes as % of the copy rate measured
// in the same run (the copy section runs first when gemv is asked for), and "rule": PD_CUDA_SKINNY=1
// (gemm.c's default rule, cuBLASLt where it picks no skinny kernel; PD_CUDA_SKINNY_MMA=3 in the
// environment gives the per-shape rule with tensor cores in that column).
// fuse: one decode layer minus attention unfused (8 kernels) vs pd_op_matmul's fused forms (4).
// fusev: the same layer at verify sizes (M = 1..16): unfused (default rule; cuBLASLt), fused on the
// CUDA-core kernel (M <= 8), fused on the tensor-core kernel (PD_CUDA_FUSE_MMA_MIN_M), single- and
// double-buffered.
// step: one batched decode layer (M = 32..256, context 512) as a graph, whole and op by op (bench_step).
// single: the single-stream decode step (M = 1, context 128) as one graph, whole and part by part,
// back to back and serial (bench_single); OPB_SINGLE_VARIANTS adds backends built with env knobs.
// pfl: one prefill layer at M = 2048 and 8192 op by op (bench_pfl; only when named).
// Usage: op_bench [copy] [peak] [gemm] [gemv] [fuse] [fusev] [prefill] [attnpre] [attn] [step] [single] [sample]
// [pfl]  (no argument: all but pfl; attnpre: prefill attention alone, bf16, head_dim 128 and 64, one and four
// sequences).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static pd_backend *g_b;
static int g_argc;
static char **g_argv;

static int want(const char *section) {
    if (g_argc < 2) return 1;
    for (int i = 1; i < g_argc; i++)
        if (!strcmp(g_argv[i], section)) return 1;
    return 0;
}

static void *alloc(size_t n) {
    pd_buffer *b = pd_buffer_alloc(g_b, n);
    if (!b) { fprintf(stderr, "alloc %zu failed\n", n); exit(1); }
    return pd_buffer_ptr(b);  // leaked on purpose: a short-lived tool
}
static double g_wstd = 0.05;  // OPB_W_STD: the standard deviation of rnd's values (single: 0.02 = the engine's dummy weights)
static void *rnd(size_t n_elems) {
    void *p = alloc(n_elems * 2);
    pd_op_fill_normal(g_b, p, PD_DTYPE_BF16, n_elems, n_elems, 0.0f, (float)g_wstd);
    return p;
}

typedef void (*op_fn)(pd_backend *b, void *arg, int rep);
static double time_us(pd_backend *b, op_fn f, void *arg, int reps) {
    for (int i = 0; i < 3; i++) f(b, arg, i);
    pd_backend_sync(b);
    int64_t t0 = pd_time_us();
    for (int i = 0; i < reps; i++) f(b, arg, i);
    pd_backend_sync(b);
    return (double)(pd_time_us() - t0) / reps;
}

#define NW 4
typedef struct mm_arg { void *a, *w[NW], *out; int M, N, K; } mm_arg;
static void mm_op(pd_backend *b, void *arg, int rep) {
    mm_arg *m = arg;
    pd_matmul_params p = {.a = m->a, .w = m->w[rep % NW], .out = m->out, .M = m->M, .N = m->N, .K = m->K};
    pd_op_matmul(b, &p);
}

// fuse: one Llama-3-8B decode layer without its attention (qkv, o, gate_up, down with their norms,
// RoPE + KV write, SwiGLU and residual adds), unfused (rmsnorm, qkv, rope_kv, o, rmsnorm, gate_up,
// silu_mul, down: 8 kernels) or through pd_op_matmul's fused forms (4 kernels), on the skinny
// backend (PD_CUDA_FUSE_ROPE=0: 5); weights alternate between two copies (> L2).
typedef struct ly_arg {
    void *x, *h, *qkv, *attn, *gu, *mlp, *g1, *g2, *wqkv[2], *wo[2], *wgu[2], *wd[2];
    pd_rope_kv_params rope;
    int M;
    bool fused;
} ly_arg;
static void ly_op(pd_backend *b, void *arg, int rep) {
    ly_arg *l = arg;
    int i = rep % 2, M = l->M, D = 4096, F = 14336, NQ = 6144;
    l->rope.n_tokens = M;
    if (l->fused) {
        pd_op_matmul(b, &(pd_matmul_params){.a = l->x, .w = l->wqkv[i], .out = l->qkv, .M = M, .N = NQ, .K = D,
                                            .norm_w = l->g1, .norm_eps = 1e-5f, .rope = &l->rope});
        pd_op_matmul(b, &(pd_matmul_params){.a = l->attn, .w = l->wo[i], .out = l->x, .M = M, .N = D, .K = D, .residual = true});
        pd_op_matmul(b, &(pd_matmul_params){.a = l->x, .w = l->wgu[i], .out = l->mlp, .M = M, .N = F, .K = D,
                                            .norm_w = l->g2, .norm_eps = 1e-5f, .glu = true});
        pd_op_matmul(b, &(pd_matmul_params){.a = l->mlp, .w = l->wd[i], .out = l->x, .M = M, .N = D, .K = F, .residual = true});
        return;
    }
    pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = l->h, .w = l->g1, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wqkv[i], .out = l->qkv, .M = M, .N = NQ, .K = D});
    pd_op_rope_kv(b, &l->rope);
    pd_op_matmul(b, &(pd_matmul_params){.a = l->attn, .w = l->wo[i], .out = l->h, .M = M, .N = D, .K = D});
    pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = l->h, .w = l->g2, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wgu[i], .out = l->gu, .M = M, .N = 2 * F, .K = D});
    pd_op_silu_mul(b, &(pd_silu_mul_params){.gu = l->gu, .out = l->mlp, .n_rows = M, .F = F});
    pd_op_matmul(b, &(pd_matmul_params){.a = l->mlp, .w = l->wd[i], .out = l->h, .M = M, .N = D, .K = F});
}

// Decode attention reads the K/V once per call; caches smaller than the 50 MB L2 would partly stay
// there from one call to the next, so each call takes the next of n copies (together >= 160 MB;
// OP_BENCH_ATTN_ROTATE=0: one copy, as before 2026-11-27).
#define AT_MAX_COPIES 64
typedef struct at_arg { pd_attention_params p; void *kc[AT_MAX_COPIES], *vc[AT_MAX_COPIES]; int n_copies; } at_arg;
static void at_op(pd_backend *b, void *arg, int rep) {
    at_arg *a = arg;
    a->p.k_cache = a->kc[rep % a->n_copies];
    a->p.v_cache = a->vc[rep % a->n_copies];
    pd_op_attention(b, &a->p);
}

typedef struct cp_arg { void *base; size_t bytes; } cp_arg;
static void cp_op(pd_backend *b, void *arg, int rep) {
    cp_arg *c = arg;
    void *kc[1] = {c->base}, *vc[1] = {(char *)c->base + 2 * c->bytes};
    int32_t src = 0, dst = 1;
    pd_copy_blocks_params p = {.k_caches = kc, .v_caches = vc, .src_blocks = &src, .dst_blocks = &dst,
                               .n = 1, .n_layers = 1, .block_bytes = c->bytes};
    pd_op_copy_blocks(b, &p);  // two independent 1 GiB copies per call
}

static void attn_setup(at_arg *a, int n_seqs, int q_len, int kv_len, int H, int Hkv, int hd, int bs, bool fp8) {
    int n_tok = n_seqs * q_len, bps = (kv_len + bs - 1) / bs, n_blocks = n_seqs * bps;
    int32_t *qi = malloc(4 * (n_seqs + 1)), *kl = malloc(4 * n_seqs), *bi = malloc(4 * (n_seqs + 1)),
            *bt = malloc(4 * (size_t)n_blocks), *ts = malloc(4 * (size_t)n_tok);
    for (int s = 0; s <= n_seqs; s++) { qi[s] = s * q_len; bi[s] = s * bps; }
    for (int s = 0; s < n_seqs; s++) kl[s] = kv_len;
    // scattered pages; OP_BENCH_ATTN_PAGES=contig: consecutive (as a fresh pool hands out a long prompt's)
    const char *pages = getenv("OP_BENCH_ATTN_PAGES");
    bool contig = pages && !strcmp(pages, "contig");
    if (pages && *pages && !contig && strcmp(pages, "scattered")) {
        fprintf(stderr, "OP_BENCH_ATTN_PAGES=%s: expected contig or scattered\n", pages);
        exit(2);
    }
    for (int i = 0; i < n_blocks; i++) bt[i] = contig ? i : (int32_t)(((int64_t)i * 7919) % n_blocks);
    for (int i = 0; i < n_tok; i++) ts[i] = i / q_len;
    int32_t *d[5];
    size_t sz[5] = {4 * (size_t)(n_seqs + 1), 4 * (size_t)n_seqs, 4 * (size_t)(n_seqs + 1), 4 * (size_t)n_blocks, 4 * (size_t)n_tok};
    int32_t *h[5] = {qi, kl, bi, bt, ts};
    for (int i = 0; i < 5; i++) { d[i] = alloc(sz[i]); pd_backend_upload(g_b, d[i], h[i], sz[i]); }
    pd_backend_sync(g_b);
    size_t kvn = (size_t)n_blocks * bs * Hkv * hd;
    size_t cache_bytes = fp8 ? pd_kv_row_bytes(g_b, PD_KV_FP8, Hkv, hd) * (size_t)n_blocks * bs : kvn * 2;
    const char *rot = getenv("OP_BENCH_ATTN_ROTATE");
    a->n_copies = rot && !strcmp(rot, "0") ? 1 : (int)((160u << 20) / (2 * cache_bytes) + 1);
    if (a->n_copies > AT_MAX_COPIES) a->n_copies = AT_MAX_COPIES;
    for (int i = 0; i < a->n_copies; i++) {
        if (fp8) {  // random e4m3 bytes; the scales are random bytes too (finite: see bench-engine)
            a->kc[i] = alloc(cache_bytes), a->vc[i] = alloc(cache_bytes);
            pd_op_fill_normal(g_b, a->kc[i], PD_DTYPE_FP8_E4M3, cache_bytes, 5 + 2 * i, 0.0f, 1.0f);
            pd_op_fill_normal(g_b, a->vc[i], PD_DTYPE_FP8_E4M3, cache_bytes, 6 + 2 * i, 0.0f, 1.0f);
        } else {
            a->kc[i] = rnd(kvn), a->vc[i] = rnd(kvn);
        }
    }
    void *kc = a->kc[0], *vc = a->vc[0];
    a->p = (pd_attention_params){.q = rnd((size_t)n_tok * H * hd), .k_cache = kc, .v_cache = vc,
                                 .kv_dtype = fp8 ? PD_KV_FP8 : PD_KV_ACT,
                                 .out = alloc((size_t)n_tok * H * hd * 2), .q_indptr = d[0], .kv_lens = d[1],
                                 .bt_indptr = d[2], .bt_indices = d[3], .token_seq = d[4], .n_tokens = n_tok,
                                 .n_seqs = n_seqs, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                 .block_size = bs, .q_stride = H * hd, .max_q_len = q_len, .max_kv_len = kv_len,
                                 .scale = 1.0f / sqrtf((float)hd)};
    free(qi); free(kl); free(bi); free(bt); free(ts);
}

// step: one Llama-3-8B decode layer at batch M (32, 64, 128, 256; context 512) as forward.c runs it
// above the fused range: rmsnorm (+ residual add), qkv, rope_kv, attention, o, rmsnorm, gate_up,
// silu_mul, down (9 kernels, cuBLASLt GEMMs). Each variant is captured as a CUDA graph of 8 layers
// (weights and KV caches alternate between 2 copies, > L2) after one eager run (cuBLASLt plans and
// tuning), then launched back to back: us per layer for the whole sequence, for the GEMMs +
// attention only (what the small kernels cost in the pipeline), and for each op alone, each next to
// its floor (weight + KV bytes at the copy rate); then lm_head (f32 logits for all M rows).
// OPB_NCU=1: M = 64 only, 3 eager layers + lm_head and exit (for ncu's per-kernel listing);
// OPB_STEP_M=m: that M only.
enum { ST_NORM1, ST_QKV, ST_ROPE, ST_ATTN, ST_O, ST_NORM2, ST_GU, ST_SILU, ST_DOWN, ST_N };
static const char *st_names[ST_N] = {"rmsnorm1", "qkv", "rope_kv", "attention", "o", "rmsnorm2", "gate_up", "silu_mul", "down"};
// One decoder layer's weights twice over (two copies, so a back-to-back loop reads from HBM, not
// L2): the two norm weights, qkv, o, gate_up and down; returns Llama-3's RoPE inverse frequencies
// (head_dim 128, theta 500000) on the device.
static float *layer_weights(void **g1, void **g2, void **wqkv, void **wo, void **wgu, void **wd, int D, int F, int NQ) {
    *g1 = alloc((size_t)D * 2), *g2 = alloc((size_t)D * 2);
    pd_op_fill_normal(g_b, *g1, PD_DTYPE_BF16, D, 7, 1.0f, 0.1f);
    pd_op_fill_normal(g_b, *g2, PD_DTYPE_BF16, D, 8, 1.0f, 0.1f);
    for (int i = 0; i < 2; i++) {
        wqkv[i] = rnd((size_t)NQ * D), wo[i] = rnd((size_t)D * D);
        wgu[i] = rnd((size_t)2 * F * D), wd[i] = rnd((size_t)D * F);
    }
    float inv_freq[64];
    for (int i = 0; i < 64; i++) inv_freq[i] = powf(500000.0f, -i / 64.0f);
    float *dinv = alloc(sizeof inv_freq);
    pd_backend_upload(g_b, dinv, inv_freq, sizeof inv_freq);
    return dinv;
}

typedef struct st_arg {
    void *x, *h, *qkv, *attn, *gu, *mlp, *g1, *g2, *wqkv[2], *wo[2], *wgu[2], *wd[2];
    pd_rope_kv_params rope[2];
    pd_attention_params at[2];
    int M;
    unsigned mask;
} st_arg;
static void st_layer(pd_backend *b, st_arg *l, int i) {
    int M = l->M, D = 4096, F = 14336, NQ = 6144;
    unsigned k = l->mask;
    if (k & (1u << ST_NORM1))
        pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = l->h, .w = l->g1, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    bool epi = pd_backend_fuses_epilogues(b, M);  // as forward.c: RoPE + KV write in qkv, SwiGLU in gate_up
    if (k & (1u << ST_QKV))
        pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wqkv[i], .out = l->qkv, .M = M, .N = NQ, .K = D,
                                            .rope = epi ? &l->rope[i] : NULL});
    if ((k & (1u << ST_ROPE)) && !epi) pd_op_rope_kv(b, &l->rope[i]);
    if (k & (1u << ST_ATTN)) pd_op_attention(b, &l->at[i]);
    if (k & (1u << ST_O)) pd_op_matmul(b, &(pd_matmul_params){.a = l->attn, .w = l->wo[i], .out = l->h, .M = M, .N = D, .K = D});
    if (k & (1u << ST_NORM2))
        pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = l->h, .w = l->g2, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    bool glu = epi;
    if ((k & (1u << ST_GU)) && glu)
        pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wgu[i], .out = l->mlp, .M = M, .N = F, .K = D, .glu = true});
    if ((k & (1u << ST_GU)) && !glu)
        pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wgu[i], .out = l->gu, .M = M, .N = 2 * F, .K = D});
    if ((k & (1u << ST_SILU)) && !glu) pd_op_silu_mul(b, &(pd_silu_mul_params){.gu = l->gu, .out = l->mlp, .n_rows = M, .F = F});
    if (k & (1u << ST_DOWN)) pd_op_matmul(b, &(pd_matmul_params){.a = l->mlp, .w = l->wd[i], .out = l->h, .M = M, .N = D, .K = F});
}
#define ST_LAYERS 8
// us per layer of the ops in l->mask: a graph of ST_LAYERS layers launched `reps` times.
static double st_time(pd_backend *b, st_arg *l, int reps) {
    st_layer(b, l, 0), st_layer(b, l, 1);  // eager: plans, tuning, scratch
    pd_backend_sync(b);
    pd_backend_graph_begin(b);
    for (int i = 0; i < ST_LAYERS; i++) st_layer(b, l, i % 2);
    pd_graph *g = pd_backend_graph_end(b);
    if (!g) { fprintf(stderr, "step: capture failed\n"); exit(1); }
    for (int i = 0; i < 2; i++) pd_backend_graph_launch(b, g);
    pd_backend_sync(b);
    int64_t t0 = pd_time_us();
    for (int i = 0; i < reps; i++) pd_backend_graph_launch(b, g);
    pd_backend_sync(b);
    double us = (double)(pd_time_us() - t0) / reps / ST_LAYERS;
    pd_backend_graph_free(b, g);
    return us;
}
typedef struct lmh_arg { void *a, *w, *out; int M; } lmh_arg;
static void lmh_op(pd_backend *b, void *arg, int rep) {
    lmh_arg *m = arg;
    pd_op_matmul(b, &(pd_matmul_params){.a = m->a, .w = m->w, .out = m->out, .M = m->M, .N = 128256, .K = 4096, .out_f32 = true});
}
static void bench_step(double copy_gbs, pd_backend **bes, const char **be_names, int n_be) {
    int D = 4096, F = 14336, NQ = 6144, H = 32, Hkv = 8, hd = 128, bs = 16, ctx = 512, MAXM = 256;
    bool ncu = getenv("OPB_NCU") && !strcmp(getenv("OPB_NCU"), "1");
    int only_m = getenv("OPB_STEP_M") ? atoi(getenv("OPB_STEP_M")) : 0;  // one M only (0: all)
    static st_arg l;
    l.x = rnd((size_t)MAXM * D), l.h = rnd((size_t)MAXM * D), l.attn = alloc((size_t)MAXM * D * 2);
    l.qkv = rnd((size_t)MAXM * NQ), l.gu = alloc((size_t)MAXM * 2 * F * 2), l.mlp = alloc((size_t)MAXM * F * 2);
    float *dinv = layer_weights(&l.g1, &l.g2, l.wqkv, l.wo, l.wgu, l.wd, D, F, NQ);
    lmh_arg lm = {.a = l.x, .w = rnd((size_t)128256 * D), .out = alloc((size_t)MAXM * 128256 * 4)};
    double w_bytes[ST_N] = {0, 2.0 * NQ * D, 0, 0, 2.0 * D * D, 0, 2.0 * 2 * F * D, 0, 2.0 * D * F};
    int Ms[] = {32, 64, 128, 256};
    for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
        int M = Ms[mi];
        if ((ncu && M != 64) || (only_m && M != only_m)) continue;
        l.M = M;
        int bps = ctx / bs, n_blocks = M * bps;
        int32_t *meta = malloc(sizeof(int32_t) * 2 * (size_t)M);  // positions, slots
        for (int s = 0; s < M; s++) {
            int blk = (int)(((int64_t)(s * bps + (ctx - 1) / bs) * 7919) % n_blocks);  // attn_setup's page table
            meta[s] = ctx - 1, meta[M + s] = blk * bs + (ctx - 1) % bs;
        }
        int32_t *dmeta = alloc(sizeof(int32_t) * 2 * (size_t)M);
        pd_backend_upload(g_b, dmeta, meta, sizeof(int32_t) * 2 * (size_t)M);
        free(meta);
        for (int i = 0; i < 2; i++) {
            at_arg a;
            attn_setup(&a, M, 1, ctx, H, Hkv, hd, bs, false);
            l.at[i] = a.p;
            l.at[i].q = l.qkv, l.at[i].q_stride = NQ, l.at[i].out = l.attn;
            l.rope[i] = (pd_rope_kv_params){.qkv = l.qkv, .positions = dmeta, .inv_freq = dinv, .slot_mapping = dmeta + M,
                                            .k_cache = (void *)a.p.k_cache, .v_cache = (void *)a.p.v_cache, .n_tokens = M,
                                            .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f};
        }
        pd_backend_sync(g_b);
        double kv_bytes = (double)M * ctx * Hkv * hd * 2 * 2;
        double floor_all = (w_bytes[ST_QKV] + w_bytes[ST_O] + w_bytes[ST_GU] + w_bytes[ST_DOWN] + kv_bytes) / (copy_gbs * 1e3);
        lm.M = M;
        for (int bi = 0; bi < n_be; bi++) {
            pd_backend *b = bes[bi];
            const char *bn = be_names[bi];
            if (ncu) {
                l.mask = (1u << ST_N) - 1;
                for (int r = 0; r < 3; r++) st_layer(b, &l, r % 2);
                lmh_op(b, &lm, 0);
                pd_backend_sync(b);
                continue;
            }
            int reps = 20;
            l.mask = (1u << ST_N) - 1;
            double t_all = st_time(b, &l, reps);
            l.mask = (1u << ST_QKV) | (1u << ST_ATTN) | (1u << ST_O) | (1u << ST_GU) | (1u << ST_DOWN);
            double t_big = st_time(b, &l, reps);
            l.mask = (1u << ST_QKV) | (1u << ST_O) | (1u << ST_GU) | (1u << ST_DOWN);
            double t_gemm = st_time(b, &l, reps);
            printf("step %-8s M=%-3d ctx=%d  layer %7.1f us (floor %6.1f us at %.0f GB/s: %3.0f%%)  gemms+attn %7.1f us  "
                   "gemms %7.1f us  => small kernels %5.1f us/layer (%.3f ms/step), %.3f ms/step for 32 layers\n",
                   bn, M, ctx, t_all, floor_all, copy_gbs, 100 * floor_all / t_all, t_big, t_gemm, t_all - t_big,
                   32 * (t_all - t_big) / 1e3, 32 * t_all / 1e3);
            // what each small kernel costs in the pipeline: the layer without it (the values are
            // wrong, the timing is the point: the ceiling of folding it into a neighbour)
            static const struct { const char *name; unsigned drop; } dr[] = {
                {"norms", (1u << ST_NORM1) | (1u << ST_NORM2)}, {"rmsnorm1", 1u << ST_NORM1}, {"rmsnorm2", 1u << ST_NORM2},
                {"rope_kv", 1u << ST_ROPE}, {"silu_mul", 1u << ST_SILU}, {"norms+silu", (1u << ST_NORM1) | (1u << ST_NORM2) | (1u << ST_SILU)}};
            for (size_t d = 0; d < sizeof dr / sizeof dr[0]; d++) {
                l.mask = ((1u << ST_N) - 1) & ~dr[d].drop;
                double t = st_time(b, &l, reps);
                printf("step %-8s M=%-3d   layer without %-10s %7.1f us (-%5.1f us/layer, -%.3f ms/step)\n", bn, M, dr[d].name, t,
                       t_all - t, 32 * (t_all - t) / 1e3);
            }
            double sum = 0;
            for (int o = 0; o < ST_N; o++) {
                l.mask = 1u << o;
                if ((o == ST_SILU || o == ST_ROPE) && pd_backend_fuses_epilogues(b, M)) continue;  // inside gate_up / qkv
                double t = st_time(b, &l, reps), by = o == ST_ATTN ? kv_bytes : w_bytes[o];
                sum += t;
                printf("step %-8s M=%-3d   %-10s alone %7.1f us", bn, M, st_names[o], t);
                if (by > 0) printf("  floor %6.1f us (%3.0f%% of copy, %5.0f GB/s)", by / (copy_gbs * 1e3), 100 * by / (copy_gbs * 1e3) / t, by / (t * 1e3));
                printf("\n");
            }
            double t_lm = time_us(b, lmh_op, &lm, 10), by_lm = 2.0 * 128256 * D;
            printf("step %-8s M=%-3d   ops alone summed %7.1f us/layer (whole layer %7.1f); lm_head f32 %7.1f us (%3.0f%% of copy)\n",
                   bn, M, sum, t_all, t_lm, 100 * by_lm / (copy_gbs * 1e3) / t_lm);
        }
    }
}

// pfl: one Llama-3-8B prefill layer of one sequence of M = 2048 and 8192 tokens (context M, causal;
// 32 heads, 8 kv heads, head_dim 128, block_size 16, scattered pages), op by op as forward.c runs it
// (rmsnorm + residual add, qkv, rope_kv, attention, o, rmsnorm + add, gate_up, silu_mul, down), each
// alone (back to back, weights alternating between 2 copies), next to its limit: GEMMs and
// attention in TFLOP/s and % of the 8192^3 peak measured here, the memory-bound kernels in GB/s
// and % of the copy rate measured here; then the classes summed, and the whole layer back to back
// for: "classic" (h holds each branch, the norms add it), "rg" (o and down accumulate into x, the
// norms read x alone: forward.c PD_MODEL_RESID_GEMM), each on cuBLASLt's heuristic choice and on
// gemm.c's prefill tuning (gemm_tune_pf). x 32 for a prefill's layers.
enum { PL_NORM1, PL_QKV, PL_ROPE, PL_ATTN, PL_O, PL_NORM2, PL_GU, PL_SILU, PL_DOWN, PL_N };
static const char *pl_names[PL_N] = {"rmsnorm1", "qkv", "rope_kv", "attention", "o", "rmsnorm2", "gate_up", "silu_mul", "down"};
typedef struct pl_arg {
    void *x, *h, *qkv, *attn, *gu, *mlp, *g1, *g2, *wqkv[2], *wo[2], *wgu[2], *wd[2];
    pd_rope_kv_params rope;
    pd_attention_params at;
    int M, only;  // only: one op (PL_*) or -1 the whole layer
    bool rg;
} pl_arg;
static void pl_op(pd_backend *b, void *arg, int rep) {
    pl_arg *l = arg;
    int M = l->M, D = 4096, F = 14336, NQ = 6144, i = rep & 1, o = l->only;
    bool rg = l->rg;
    if (o < 0 || o == PL_NORM1)
        pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = rg ? NULL : l->h, .w = l->g1, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    if (o < 0 || o == PL_QKV) pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wqkv[i], .out = l->qkv, .M = M, .N = NQ, .K = D});
    if (o < 0 || o == PL_ROPE) pd_op_rope_kv(b, &l->rope);
    if (o < 0 || o == PL_ATTN) pd_op_attention(b, &l->at);
    if (o < 0 || o == PL_O)
        pd_op_matmul(b, &(pd_matmul_params){.a = l->attn, .w = l->wo[i], .out = rg ? l->x : l->h, .M = M, .N = D, .K = D, .accumulate = rg});
    if (o < 0 || o == PL_NORM2)
        pd_op_rmsnorm(b, &(pd_rmsnorm_params){.x = l->x, .add = rg ? NULL : l->h, .w = l->g2, .out = l->h, .n_rows = M, .dim = D, .eps = 1e-5f});
    if (o < 0 || o == PL_GU) pd_op_matmul(b, &(pd_matmul_params){.a = l->h, .w = l->wgu[i], .out = l->gu, .M = M, .N = 2 * F, .K = D});
    if (o < 0 || o == PL_SILU) pd_op_silu_mul(b, &(pd_silu_mul_params){.gu = l->gu, .out = l->mlp, .n_rows = M, .F = F});
    if (o < 0 || o == PL_DOWN)
        pd_op_matmul(b, &(pd_matmul_params){.a = l->mlp, .w = l->wd[i], .out = rg ? l->x : l->h, .M = M, .N = D, .K = F, .accumulate = rg});
}
static void bench_pfl(void) {
    int D = 4096, F = 14336, NQ = 6144, H = 32, Hkv = 8, hd = 128, bs = 16, MAXM = 8192;
    cp_arg cp = {.bytes = (size_t)1 << 30};
    cp.base = alloc(4 * cp.bytes);
    pd_op_fill_normal(g_b, cp.base, PD_DTYPE_F32, cp.bytes, 1, 0.0f, 1.0f);
    double copy_gbs = 2.0 * 2.0 * cp.bytes / (time_us(g_b, cp_op, &cp, 10) * 1e3);
    mm_arg pk = {.M = 8192, .N = 8192, .K = 8192, .a = rnd((size_t)8192 * 8192), .out = alloc((size_t)8192 * 8192 * 2)};
    pk.w[0] = pk.w[1] = pk.w[2] = pk.w[3] = rnd((size_t)8192 * 8192);
    double peak_tfs = 2.0 * 8192.0 * 8192 * 8192 / (time_us(g_b, mm_op, &pk, 20) * 1e6);
    printf("pfl copy %.0f GB/s (read+write), gemm 8192^3 %.1f TFLOP/s (cuBLASLt heuristic)\n", copy_gbs, peak_tfs);
    // heuristic: cuBLASLt's first choice (PD_CUDA_GEMM_TUNE_PF=0); tuned: gemm.c's prefill tuning
    // (opt-in: PD_CUDA_GEMM_TUNE_PF from the environment, else 1024)
    const char *tpf = getenv("PD_CUDA_GEMM_TUNE_PF");
    char tpf_save[32] = "";
    if (tpf) snprintf(tpf_save, sizeof tpf_save, "%s", tpf);
    setenv("PD_CUDA_GEMM_TUNE_PF", "0", 1);
    pd_err err = {0};
    pd_backend *hb = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_GEMM_TUNE_PF", *tpf_save && strcmp(tpf_save, "0") ? tpf_save : "1024", 1);
    pd_backend *tb = pd_backend_new("cuda", 0, &err);
    if (*tpf_save) setenv("PD_CUDA_GEMM_TUNE_PF", tpf_save, 1);
    else unsetenv("PD_CUDA_GEMM_TUNE_PF");
    if (!tb || !hb) { fprintf(stderr, "pfl: no backend: %s\n", err.msg); exit(1); }
    static pl_arg l;
    l.x = rnd((size_t)MAXM * D), l.h = rnd((size_t)MAXM * D), l.attn = rnd((size_t)MAXM * D);
    l.qkv = rnd((size_t)MAXM * NQ), l.gu = rnd((size_t)MAXM * 2 * F), l.mlp = rnd((size_t)MAXM * F);
    float *dinv = layer_weights(&l.g1, &l.g2, l.wqkv, l.wo, l.wgu, l.wd, D, F, NQ);
    int Ms[] = {2048, 8192};
    for (int mi = 0; mi < 2; mi++) {
        int M = Ms[mi], reps = M >= 8192 ? 5 : 10, n_blocks = (M + bs - 1) / bs;
        at_arg a;
        setenv("OP_BENCH_ATTN_ROTATE", "0", 1);  // one cache, as a prefill writes and reads
        attn_setup(&a, 1, M, M, H, Hkv, hd, bs, false);
        unsetenv("OP_BENCH_ATTN_ROTATE");
        l.M = M, l.at = a.p, l.at.q = l.qkv, l.at.q_stride = NQ, l.at.out = l.attn;
        int32_t *meta = malloc(sizeof(int32_t) * 2 * (size_t)M);  // positions, slots (attn_setup's page table)
        for (int t = 0; t < M; t++)
            meta[t] = t, meta[M + t] = (int32_t)((((int64_t)(t / bs) * 7919) % n_blocks) * bs + t % bs);
        int32_t *dmeta = alloc(sizeof(int32_t) * 2 * (size_t)M);
        pd_backend_upload(g_b, dmeta, meta, sizeof(int32_t) * 2 * (size_t)M);
        free(meta);
        l.rope = (pd_rope_kv_params){.qkv = l.qkv, .positions = dmeta, .inv_freq = dinv, .slot_mapping = dmeta + M,
                                     .k_cache = (void *)a.p.k_cache, .v_cache = (void *)a.p.v_cache, .n_tokens = M,
                                     .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f};
        pd_backend_sync(g_b);
        double e = 2, MD = (double)M * D * e;
        double fl[PL_N] = {0, 2.0 * M * NQ * D, 0, 4.0 * H * hd * (double)M * (M + 1) / 2, 2.0 * M * D * D, 0,
                           2.0 * M * 2 * F * D, 0, 2.0 * M * D * F};
        // bytes moved: norm x + h read, both written (rg: x read, h written); rope_kv q, k read and
        // written, k and v written to the cache (v read); silu_mul gu read, mlp written
        double by[PL_N] = {4 * MD, 0, (double)M * (H + 2 * Hkv) * hd * e * 2, 0, 0, 4 * MD, 0, (double)M * 3 * F * e, 0};
        pd_backend *bes[2] = {hb, tb};
        const char *bn[2] = {"heuristic", "tuned"};
        for (int bi = 0; bi < 2; bi++) {
            pd_backend *b = bes[bi];
            double cls[3] = {0, 0, 0};  // gemm, attention, memory-bound
            for (int rg = 0; rg < 2; rg++)
                for (int o = 0; o < PL_N; o++) {
                    bool gemm = o == PL_QKV || o == PL_O || o == PL_GU || o == PL_DOWN;
                    if (rg && !(o == PL_O || o == PL_DOWN || o == PL_NORM1)) continue;  // the ops rg changes
                    if (bi && !gemm && !rg) continue;  // the other ops do not depend on the GEMM choice
                    if (bi && rg && !gemm) continue;
                    l.rg = rg, l.only = o;
                    double us = time_us(b, pl_op, &l, reps);
                    double bytes = by[o] * (rg && o == PL_NORM1 ? 0.5 : 1);
                    printf("pfl M=%-5d %-9s %-10s%s %9.1f us", M, bn[bi], pl_names[o], rg ? " rg" : "   ", us);
                    if (fl[o] > 0) printf("  %6.1f TFLOP/s  %5.1f%% of peak", fl[o] / (us * 1e6), 100 * fl[o] / (us * 1e6) / peak_tfs);
                    if (bytes > 0) printf("  %6.0f GB/s  %5.1f%% of copy", bytes / (us * 1e3), 100 * bytes / (us * 1e3) / copy_gbs);
                    printf("  (x32 %.2f ms)\n", 32 * us / 1e3);
                    if (!rg) cls[gemm ? 0 : o == PL_ATTN ? 1 : 2] += us;
                }
            double gfl = fl[PL_QKV] + fl[PL_O] + fl[PL_GU] + fl[PL_DOWN];
            if (!bi)
                printf("pfl M=%-5d %-9s classes x32: gemms %.2f ms (%.1f%% of peak; at peak %.2f), attention %.2f ms (%.1f TFLOP/s), "
                       "memory-bound %.2f ms\n", M, bn[bi], 32 * cls[0] / 1e3, 100 * gfl / (cls[0] * 1e6) / peak_tfs,
                       32 * gfl / (peak_tfs * 1e9), 32 * cls[1] / 1e3, fl[PL_ATTN] / (cls[1] * 1e6), 32 * cls[2] / 1e3);
            else
                printf("pfl M=%-5d %-9s gemms x32 %.2f ms (%.1f%% of peak)\n", M, bn[bi], 32 * cls[0] / 1e3,
                       100 * gfl / (cls[0] * 1e6) / peak_tfs);
            for (int rg = 0; rg < 2; rg++) {
                l.rg = rg, l.only = -1;
                double us = time_us(b, pl_op, &l, reps);
                printf("pfl M=%-5d %-9s whole layer %-7s %9.1f us  (x32 %.2f ms)\n", M, bn[bi], rg ? "rg" : "classic", us, 32 * us / 1e3);
            }
        }
    }
}

// single: the single-stream decode step (M = 1, context 128) as forward.c runs it on the fused path:
// embed, 32 x (qkv + norm + RoPE + KV write, attention, o += x, gate_up + norm + SwiGLU, down += x),
// get_rows, lm_head + final norm (f32 logits); each variant (a subset of those parts) captured as one
// CUDA graph (layer li's weights are set li % N of OPB_SINGLE_LAYERS=N distinct sets, default 2,
// each > L2; 32: the model's footprint; OPB_SINGLE_NORMS=1: each set its own norm weights, as the
// engine's layers, else one pair shared and always cached; K/V of 2 caches) and timed four ways: back to back (20
// launches, one sync: the device's time), back to back with the 128-byte metadata upload before each
// launch (bench-engine's "pipelined" step), serial (launch + sync each: what the host adds), serial
// with the upload (as forward.c's graph_step does; the upload and launch calls' own host time
// printed). Variants: the whole step (lm_head reads x, as forward.c's one-token step) with
// attention's K/V loaded before its PDL wait (n_new = 1, a graph step) and after it ("late kv");
// with get_rows; without attention; without lm_head; the GEMMs alone; attention alone (early and
// late); lm_head alone; embed + get_rows; the first two again at the end (drift).
enum { SG_EMBED = 1, SG_ATTN = 4, SG_ROWS = 8, SG_LMH = 16, SG_QKV = 32, SG_O = 64, SG_GU = 128, SG_DN = 256 };
#define SG_GEMMS (SG_QKV | SG_O | SG_GU | SG_DN)
#define SG_MAX_COPIES 32
typedef struct sg_arg {
    void *x, *qkv, *attn, *mlp, *sel, *logits, *g1, *g2, *gf, *lmh, *meta_dev;
    void *wqkv[SG_MAX_COPIES], *wo[SG_MAX_COPIES], *wgu[SG_MAX_COPIES], *wd[SG_MAX_COPIES];
    void *g1s[SG_MAX_COPIES], *g2s[SG_MAX_COPIES];  // OPB_SINGLE_NORMS=1: each weight set's own norm weights
    int n_copies;  // distinct weight sets, layer li uses set li % n_copies (OPB_SINGLE_LAYERS)
    int32_t *ids;
    pd_rope_kv_params rope[2];
    pd_attention_params at[2];
    unsigned mask;
} sg_arg;
static void sg_step(pd_backend *b, sg_arg *s) {
    int D = 4096, F = 14336, NQ = 6144, V = 128256;
    unsigned k = s->mask;
    if (k & SG_EMBED) pd_op_embed(b, &(pd_embed_params){.ids = s->ids, .table = s->lmh, .out = s->x, .n_tokens = 1, .dim = D, .vocab = V});
    for (int li = 0; li < 32; li++) {
        int i = li % 2, wi = li % s->n_copies;
        if (k & SG_QKV)
            pd_op_matmul(b, &(pd_matmul_params){.a = s->x, .w = s->wqkv[wi], .out = s->qkv, .M = 1, .N = NQ, .K = D,
                                                .norm_w = s->g1s[wi] ? s->g1s[wi] : s->g1, .norm_eps = 1e-5f, .rope = &s->rope[i]});
        if (k & SG_ATTN) pd_op_attention(b, &s->at[i]);
        if (k & SG_O)
            pd_op_matmul(b, &(pd_matmul_params){.a = s->attn, .w = s->wo[wi], .out = s->x, .M = 1, .N = D, .K = D, .residual = true});
        if (k & SG_GU)
            pd_op_matmul(b, &(pd_matmul_params){.a = s->x, .w = s->wgu[wi], .out = s->mlp, .M = 1, .N = F, .K = D,
                                                .norm_w = s->g2s[wi] ? s->g2s[wi] : s->g2, .norm_eps = 1e-5f, .glu = true});
        if (k & SG_DN)
            pd_op_matmul(b, &(pd_matmul_params){.a = s->mlp, .w = s->wd[wi], .out = s->x, .M = 1, .N = D, .K = F, .residual = true});
    }
    if (k & SG_ROWS) pd_op_get_rows(b, &(pd_get_rows_params){.x = s->x, .idx = s->ids + 1, .out = s->sel, .n_rows = 1, .dim = D});
    if (k & SG_LMH)
        pd_op_matmul(b, &(pd_matmul_params){.a = (k & SG_ROWS) ? s->sel : s->x, .w = s->lmh, .out = s->logits, .M = 1, .N = V,
                                            .K = D, .out_f32 = true, .norm_w = s->gf, .norm_eps = 1e-5f});
}
static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
// us per step: [0] back to back, [1] serial (median), [2] serial with the metadata upload (median),
// [3] back to back with the upload before each launch (bench-engine's "pipelined" step); [4..7]
// the upload call's and the graph launch call's host time in the serial steps (median, max).
static void sg_time(pd_backend *b, sg_arg *s, double out[8]) {
    sg_step(b, s);  // eager: scratch, plans
    pd_backend_sync(b);
    pd_backend_graph_begin(b);
    sg_step(b, s);
    pd_graph *g = pd_backend_graph_end(b);
    if (!g) { fprintf(stderr, "single: capture failed\n"); exit(1); }
    int32_t meta[32] = {0};
    meta[1] = 127, meta[2] = 31;
    for (int i = 0; i < 3; i++) pd_backend_graph_launch(b, g);
    pd_backend_sync(b);
    int reps = 20;
    int64_t t0 = pd_time_us();
    for (int i = 0; i < reps; i++) pd_backend_graph_launch(b, g);
    pd_backend_sync(b);
    out[0] = (double)(pd_time_us() - t0) / reps;
    t0 = pd_time_us();
    for (int i = 0; i < reps; i++) {
        pd_backend_upload(b, s->meta_dev, meta, sizeof meta);
        pd_backend_graph_launch(b, g);
    }
    pd_backend_sync(b);
    out[3] = (double)(pd_time_us() - t0) / reps;
    double t[2][20], tu[20], tl[20];  // tu, tl: the upload and launch calls' own host time (serial + upload)
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < reps; i++) {
            int64_t t1 = pd_time_us();
            if (v) pd_backend_upload(b, s->meta_dev, meta, sizeof meta);
            int64_t t2 = pd_time_us();
            pd_backend_graph_launch(b, g);
            int64_t t3 = pd_time_us();
            pd_backend_sync(b);
            t[v][i] = (double)(pd_time_us() - t1);
            if (v) tu[i] = (double)(t2 - t1), tl[i] = (double)(t3 - t2);
        }
    for (int v = 0; v < 2; v++) {
        qsort(t[v], (size_t)reps, sizeof(double), cmp_dbl);
        out[1 + v] = t[v][reps / 2];
    }
    qsort(tu, (size_t)reps, sizeof(double), cmp_dbl);
    qsort(tl, (size_t)reps, sizeof(double), cmp_dbl);
    out[4] = tu[reps / 2], out[5] = tu[reps - 1], out[6] = tl[reps / 2], out[7] = tl[reps - 1];
    pd_backend_graph_free(b, g);
}
static void bench_single(double copy_gbs, pd_backend **bes, const char **be_names, int n_be) {
    int D = 4096, F = 14336, NQ = 6144, V = 128256, H = 32, Hkv = 8, hd = 128, bs = 16, ctx = 128;
    static sg_arg s;
    s.x = rnd(D), s.qkv = rnd(NQ), s.attn = rnd(D), s.mlp = alloc((size_t)F * 2), s.sel = alloc((size_t)D * 2);
    s.logits = alloc((size_t)V * 4);
    s.g1 = alloc((size_t)D * 2), s.g2 = alloc((size_t)D * 2), s.gf = alloc((size_t)D * 2);
    pd_op_fill_normal(g_b, s.g1, PD_DTYPE_BF16, D, 7, 1.0f, 0.1f);
    pd_op_fill_normal(g_b, s.g2, PD_DTYPE_BF16, D, 8, 1.0f, 0.1f);
    pd_op_fill_normal(g_b, s.gf, PD_DTYPE_BF16, D, 9, 1.0f, 0.1f);
    // OPB_SINGLE_LAYERS=N: N distinct weight sets (default 2, each > L2; 32: the model's 14 GB
    // footprint, as bench-engine's step reads it)
    pd_err eerr = {0};
    if (pd_env_int("OPB_SINGLE_LAYERS", 2, 1, SG_MAX_COPIES, &s.n_copies, &eerr)) { fprintf(stderr, "%s\n", eerr.msg); exit(2); }
    if (pd_env_double("OPB_W_STD", 0.05, 1e-4, 1.0, &g_wstd, &eerr)) { fprintf(stderr, "%s\n", eerr.msg); exit(2); }
    // OPB_SINGLE_NORMS=1: every weight set its own norm weights (the engine's, each read once a
    // step); 0 (default): one pair shared by all layers (always cached)
    bool own_norms = false;
    if (pd_env_switch("OPB_SINGLE_NORMS", false, &own_norms, &eerr)) { fprintf(stderr, "%s\n", eerr.msg); exit(2); }
    for (int i = 0; i < s.n_copies; i++) {
        if (own_norms) {
            s.g1s[i] = alloc((size_t)D * 2), s.g2s[i] = alloc((size_t)D * 2);
            pd_op_fill_normal(g_b, s.g1s[i], PD_DTYPE_BF16, D, 100 + (uint64_t)i, 1.0f, 0.1f);
            pd_op_fill_normal(g_b, s.g2s[i], PD_DTYPE_BF16, D, 200 + (uint64_t)i, 1.0f, 0.1f);
        }
        s.wqkv[i] = rnd((size_t)NQ * D), s.wo[i] = rnd((size_t)D * D);
        s.wgu[i] = rnd((size_t)2 * F * D), s.wd[i] = rnd((size_t)D * F);
    }
    printf("single: %d distinct layer weight sets, weights N(0, %g), norm weights %s\n", s.n_copies, g_wstd,
           own_norms ? "per set" : "shared");
    s.lmh = rnd((size_t)V * D);
    // ids: [0] the token, [1] the logit row (0); positions / slots after them (the step's metadata)
    int32_t meta[4] = {12345, 0, ctx - 1, 0};
    int bps = ctx / bs;
    meta[3] = (int32_t)((((int64_t)(ctx - 1) / bs) * 7919) % bps) * bs + (ctx - 1) % bs;  // attn_setup's page table
    s.ids = alloc(sizeof meta);
    s.meta_dev = alloc(128);
    pd_backend_upload(g_b, s.ids, meta, sizeof meta);
    float inv_freq[64];
    for (int i = 0; i < 64; i++) inv_freq[i] = powf(500000.0f, -i / 64.0f);
    float *dinv = alloc(sizeof inv_freq);
    pd_backend_upload(g_b, dinv, inv_freq, sizeof inv_freq);
    for (int i = 0; i < 2; i++) {
        at_arg a;
        attn_setup(&a, 1, 1, ctx, H, Hkv, hd, bs, false);
        s.at[i] = a.p;
        s.at[i].q = s.qkv, s.at[i].q_stride = NQ, s.at[i].out = s.attn;
        s.at[i].max_kv_len = 256;  // the bound a graph step at context 128 runs with (forward.c kv_bucket)
        s.at[i].n_new = 1;         // as a graph step (forward.c graph_step); variants below set 0
        s.rope[i] = (pd_rope_kv_params){.qkv = s.qkv, .positions = s.ids + 2, .inv_freq = dinv, .slot_mapping = s.ids + 3,
                                        .k_cache = (void *)a.p.k_cache, .v_cache = (void *)a.p.v_cache, .n_tokens = 1,
                                        .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .attn_scaling = 1.0f};
    }
    pd_backend_sync(g_b);
    double layer_w = 2.0 * ((double)NQ * D + (double)D * D + 2.0 * F * D + (double)D * F), lm_w = 2.0 * V * D;
    double kv = 2.0 * ctx * Hkv * hd * 2;  // one layer's K and V rows
    // early: attention's n_new (1: K/V rows before the new one loaded before the PDL wait; 0: none)
    // sh: in the short list (OPB_SINGLE_SHORT=1: only those)
    struct { const char *name; unsigned mask; double bytes; int early, sh; } vs[] = {
        {"whole step", SG_EMBED | SG_GEMMS | SG_ATTN | SG_LMH, 32 * (layer_w + kv) + lm_w, 1, 1},
        {"whole, late kv", SG_EMBED | SG_GEMMS | SG_ATTN | SG_LMH, 32 * (layer_w + kv) + lm_w, 0, 0},
        {"with get_rows", SG_EMBED | SG_GEMMS | SG_ATTN | SG_ROWS | SG_LMH, 32 * (layer_w + kv) + lm_w, 1, 0},
        {"no attention", SG_EMBED | SG_GEMMS | SG_LMH, 32 * layer_w + lm_w, 1, 1},
        {"layers only", SG_EMBED | SG_GEMMS | SG_ATTN, 32 * (layer_w + kv), 1, 0},
        {"gemms only", SG_GEMMS, 32 * layer_w, 1, 1},
        {"qkv only", SG_QKV, 32 * 2.0 * NQ * D, 1, 1},
        {"o only", SG_O, 32 * 2.0 * D * D, 1, 1},
        {"gate_up only", SG_GU, 32 * 2.0 * 2 * F * D, 1, 1},
        {"down only", SG_DN, 32 * 2.0 * F * D, 1, 1},
        {"o+down only", SG_O | SG_DN, 32 * 2.0 * (D * D + F * D), 1, 0},
        {"attention only", SG_ATTN, 32 * kv, 1, 0},
        {"attn only late", SG_ATTN, 32 * kv, 0, 0},
        {"lm_head only", SG_LMH, lm_w, 1, 1},
        {"embed+get_rows", SG_EMBED | SG_ROWS, 0, 1, 0},
        {"whole step", SG_EMBED | SG_GEMMS | SG_ATTN | SG_LMH, 32 * (layer_w + kv) + lm_w, 1, 1},
        {"whole, late kv", SG_EMBED | SG_GEMMS | SG_ATTN | SG_LMH, 32 * (layer_w + kv) + lm_w, 0, 0},
    };
    bool short_only = false;
    if (pd_env_switch("OPB_SINGLE_SHORT", false, &short_only, &eerr)) { fprintf(stderr, "%s\n", eerr.msg); exit(2); }
    for (int bi = 0; bi < n_be; bi++)
        for (size_t v = 0; v < sizeof vs / sizeof vs[0]; v++) {
            if (short_only && !vs[v].sh) continue;
            s.mask = vs[v].mask;
            s.at[0].n_new = s.at[1].n_new = vs[v].early;
            double t[8];
            sg_time(bes[bi], &s, t);
            double fl = vs[v].bytes / (copy_gbs * 1e3);
            printf("single %-6s %-15s back-to-back %8.1f us  b2b+upload %8.1f us (+%5.1f)  serial %8.1f us (+%5.1f)  serial+upload %8.1f us (+%5.1f)",
                   be_names[bi], vs[v].name, t[0], t[3], t[3] - t[0], t[1], t[1] - t[0], t[2], t[2] - t[0]);
            if (vs[v].bytes > 0)
                printf("  floor %8.1f us at %.0f GB/s: %5.1f%% (%5.0f GB/s)", fl, copy_gbs, 100 * fl / t[0], vs[v].bytes / (t[0] * 1e3));
            printf("  host: upload call %.0f (max %.0f) us, launch call %.0f (max %.0f) us", t[4], t[5], t[6], t[7]);
            printf("\n");
        }
}

typedef struct sm_arg { pd_sample_params p; pd_sample_row rows[256]; pd_sample_out out[256]; } sm_arg;
static void sm_op(pd_backend *b, void *arg, int rep) {
    sm_arg *s = arg;
    for (int r = 0; r < s->p.n_rows; r++) s->rows[r].draw_idx = (uint64_t)rep;  // a new draw each call
    pd_op_sample(b, &s->p);
}

// Logits like a model's: normal(0, 2.5), with a few tokens lifted (a peaked head), f32 on the device.
static float *sample_logits(int n_rows, int V) {
    size_t n = (size_t)n_rows * V;
    float *d = alloc(n * 4);
    pd_op_fill_normal(g_b, d, PD_DTYPE_F32, n, 11, 0.0f, 2.5f);
    float *h = malloc(n * 4);
    pd_backend_download(g_b, h, d, n * 4);
    for (int r = 0; r < n_rows; r++)
        for (int j = 0; j < 8; j++) h[(size_t)r * V + (size_t)(j * 7919 + r * 31) % V] += 12.0f - j;
    pd_backend_upload(g_b, d, h, n * 4);
    pd_backend_sync(g_b);
    free(h);
    return d;
}

static void bench_sample(void) {
    static sm_arg s;
    struct { const char *name; float t; int k; float p, min_p; } cfg[] = {
        {"greedy", 0.0f, 0, 1.0f, 0}, {"temperature 0.8", 0.8f, 0, 1.0f, 0}, {"top-k 40", 1.0f, 40, 1.0f, 0},
        {"top-p 0.9", 1.0f, 0, 0.9f, 0}, {"top-k 40 + top-p 0.95", 1.0f, 40, 0.95f, 0}, {"top-p 0.95", 1.0f, 0, 0.95f, 0},
        {"top-p 0.9 + min-p 0.05", 1.0f, 0, 0.9f, 0.05f}, {"min-p 0.05", 1.0f, 0, 1.0f, 0.05f}};
    int vocabs[] = {32000, 128256, 152064}, batches[] = {1, 8, 64, 256};
    float *small = sample_logits(1, 1024);
    for (int r = 0; r < 256; r++)
        s.rows[r] = (pd_sample_row){.temperature = 0, .top_p = 1.0f, .repetition_penalty = 1.0f, .seed = 1234 + r,
                                    .n_logprobs = -1, .mask_row = -1};
    s.p = (pd_sample_params){.logits = small, .n_rows = 1, .vocab = 1024, .rows = s.rows, .out = s.out};
    printf("sample V=1024   B=1   %-22s %9.1f us/call (the op's fixed cost)\n", "greedy", time_us(g_b, sm_op, &s, 200));
    for (int v = 0; v < 3; v++) {
        float *lg = sample_logits(256, vocabs[v]);
        for (int bi = 0; bi < 4; bi++)
            for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
                for (int r = 0; r < batches[bi]; r++)
                    s.rows[r].temperature = cfg[c].t, s.rows[r].top_k = cfg[c].k, s.rows[r].top_p = cfg[c].p,
                    s.rows[r].min_p = cfg[c].min_p;
                s.p = (pd_sample_params){.logits = lg, .n_rows = batches[bi], .vocab = vocabs[v], .rows = s.rows, .out = s.out};
                double us = time_us(g_b, sm_op, &s, batches[bi] >= 64 ? 20 : 100);
                printf("sample V=%-6d B=%-3d %-22s %9.1f us/call %8.2f us/row\n", vocabs[v], batches[bi], cfg[c].name, us,
                       us / batches[bi]);
            }
    }
}

int main(int argc, char **argv) {
    pd_err err = {0};
    g_argc = argc, g_argv = argv;
    const char *lvl = getenv("PDSERVE_LOG");  // debug: cuBLASLt's tuning choices
    if (lvl && !strcmp(lvl, "debug")) pd_log_set_level(PD_LOG_DEBUG);
    char rule_mma[16] = "";  // the caller's PD_CUDA_SKINNY_MMA, for the "rule" backend
    const char *env_mma = getenv("PD_CUDA_SKINNY_MMA");
    if (env_mma) snprintf(rule_mma, sizeof rule_mma, "%s", env_mma);
    const char *env_bg = getenv("PD_CUDA_BGEMM");  // the caller's: 0 leaves the batched-decode GEMM out
    bool bg_on = !(env_bg && !strcmp(env_bg, "0"));
    setenv("PD_CUDA_GEMV_MAX_M", "0", 1);  // g_b: cuBLASLt for every M
    setenv("PD_CUDA_SKINNY", "0", 1);
    setenv("PD_CUDA_BGEMM", "0", 1);
    g_b = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_BGEMM", "1", 1);  // bg: the batched-decode GEMM for 17 <= M <= 64 (kernels/bgemm.cu)
    pd_backend *bg = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_BGEMM", "0", 1);  // every other backend: without it
    setenv("PD_CUDA_GEMV_MAX_M", "16", 1);  // lt: the stream-K gemv kernel for M <= 16
    pd_backend *lt = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_GEMV_MAX_M", "0", 1);
    setenv("PD_CUDA_SKINNY", "2", 1);  // sk: the row-streaming (CUDA-core) skinny kernel for every M <= 8
    setenv("PD_CUDA_SKINNY_MMA", "0", 1);
    pd_backend *sk = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_SKINNY_MMA", "2", 1);  // mma: the tensor-core skinny kernel for every M <= 16
    pd_backend *mma = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_SKINNY_MMA_ROWS", "32", 1);  // mma32: the same with 32 weight rows per block
    pd_backend *mma32 = pd_backend_new("cuda", 0, &err);
    setenv("PD_CUDA_SKINNY_MMA_PIPE", "1", 1);  // mma32p, mma16p: double-buffered weight loads
    pd_backend *mma32p = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_SKINNY_MMA_ROWS");
    pd_backend *mma16p = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_SKINNY_MMA_PIPE");
    unsetenv("PD_CUDA_SKINNY_MMA");
    setenv("PD_CUDA_SKINNY", "1", 1);  // rule: the default rule (gemm.c skinny_rule) or the caller's
    if (*rule_mma) setenv("PD_CUDA_SKINNY_MMA", rule_mma, 1);
    pd_backend *rule = pd_backend_new("cuda", 0, &err);
    unsetenv("PD_CUDA_SKINNY_MMA");
    setenv("PD_CUDA_SKINNY", "2", 1);
    unsetenv("PD_CUDA_BGEMM");
    if (!g_b || !bg || !lt || !sk || !mma || !mma32 || !mma32p || !mma16p || !rule) { fprintf(stderr, "no cuda: %s\n", err.msg); return 1; }
    double us, copy_gbs = NAN;
    if (want("copy") || want("gemv") || want("fuse") || want("fusev") || want("step") || want("single")) {
        cp_arg cp = {.bytes = (size_t)1 << 30};
        cp.base = alloc(4 * cp.bytes);
        pd_op_fill_normal(g_b, cp.base, PD_DTYPE_F32, cp.bytes, 1, 0.0f, 1.0f);
        us = time_us(g_b, cp_op, &cp, 10);
        copy_gbs = 2.0 * 2.0 * cp.bytes / (us * 1e3);  // 2 copies x (read + write)
        printf("copy 1GiB x2 (kernel)      %9.1f us  %7.0f GB/s (read+write)\n", us, copy_gbs);
    }
    if (want("peak")) {
        mm_arg m = {.M = 8192, .N = 8192, .K = 8192};
        m.a = rnd((size_t)8192 * 8192);
        for (int i = 0; i < NW; i++) m.w[i] = i ? m.w[0] : rnd((size_t)8192 * 8192);
        m.out = alloc((size_t)8192 * 8192 * 2);
        us = time_us(g_b, mm_op, &m, 20);
        printf("gemm 8192^3 (cuBLASLt)     %9.1f us  %7.1f TFLOP/s\n", us, 2.0 * 8192.0 * 8192 * 8192 / (us * 1e6));
    }
    int shapes[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}, {128256, 4096}};
    const char *names[] = {"qkv", "o", "gate_up", "down", "lm_head"};
    int Ms[] = {1, 4, 8, 16, 32, 64, 128, 256};
    for (size_t s = 0; s < 5 && (want("gemm") || want("prefill")); s++) {
        int N = shapes[s][0], K = shapes[s][1];
        mm_arg m = {.N = N, .K = K};
        m.a = rnd((size_t)8192 * K);
        int nw = (size_t)N * K * 2 > (64u << 20) ? 2 : NW;
        for (int i = 0; i < NW; i++) m.w[i] = i < nw ? rnd((size_t)N * K) : m.w[i % nw];
        m.out = alloc((size_t)8192 * N * 4);
        for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0] && want("gemm"); mi++) {
            m.M = Ms[mi];
            double bytes = (double)N * K * 2;
            double t_g = Ms[mi] <= 16 ? time_us(lt, mm_op, &m, 50) : NAN;
            double t_l = time_us(g_b, mm_op, &m, 50);
            double t_b = m.M >= 17 && m.M <= 64 ? time_us(bg, mm_op, &m, 50) : NAN;
            printf("%-8s M=%-4d N=%-6d K=%-5d  gemv %8.1f us (%5.0f GB/s)  cublasLt %8.1f us (%5.0f GB/s)  bgemm %8.1f us (%5.0f GB/s)\n",
                   names[s], m.M, N, K, t_g, bytes / (t_g * 1e3), t_l, bytes / (t_l * 1e3), t_b, bytes / (t_b * 1e3));
        }
        if (!want("prefill")) continue;
        m.M = 8192;
        double t = time_us(g_b, mm_op, &m, 10);
        printf("%-8s M=8192 prefill            cublasLt %8.1f us  %6.1f TFLOP/s\n", names[s], t,
               2.0 * 8192 * N * K / (t * 1e6));
    }
    for (size_t s = 0; s < 5 && want("gemv"); s++) {
        int N = shapes[s][0], K = shapes[s][1], gm[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16};
        mm_arg m = {.N = N, .K = K};
        m.a = rnd((size_t)16 * K);
        int nw = (size_t)N * K * 2 > (64u << 20) ? 2 : NW;
        for (int i = 0; i < NW; i++) m.w[i] = i < nw ? rnd((size_t)N * K) : m.w[i % nw];
        m.out = alloc((size_t)16 * N * 2);
        double bytes = (double)N * K * 2;
        for (size_t mi = 0; mi < sizeof gm / sizeof gm[0]; mi++) {
            m.M = gm[mi];
            int reps = bytes > 5e8 ? 20 : 100;
            // cuBLASLt, the CUDA-core kernel (M <= 8), the tensor-core kernel with 16 and 32 rows per
            // block, single- and double-buffered
            pd_backend *be[7] = {g_b, sk, mma, mma32, mma16p, mma32p, rule};
            const char *name[7] = {"cublasLt", "cores", "mma16", "mma32", "mma16p", "mma32p", "rule"};
            double t[7];
            int best = 0;
            for (int k = 0; k < 7; k++) {
                t[k] = k == 1 && m.M > 8 ? NAN : time_us(be[k], mm_op, &m, reps);
                if (t[k] < t[best]) best = k;  // NaN compares false: never the best
            }
            printf("gemv %-8s M=%-2d N=%-6d K=%-5d", names[s], m.M, N, K);
            for (int k = 0; k < 7; k++) printf("  %s %5.1f us %3.0f%%", name[k], t[k], 100 * bytes / (t[k] * 1e3) / copy_gbs);
            printf("  best %s (%.2fx cublasLt; %% of copy %.0f GB/s)\n", name[best], t[0] / t[best], copy_gbs);
        }
    }
    if (want("fuse") || want("fusev")) {
        ly_arg l = {0};
        int D = 4096, F = 14336, NQ = 6144;
        l.x = rnd((size_t)16 * D), l.h = rnd((size_t)16 * D), l.attn = rnd((size_t)16 * D);
        l.qkv = alloc((size_t)16 * NQ * 2), l.gu = alloc((size_t)16 * 2 * F * 2), l.mlp = alloc((size_t)16 * F * 2);
        l.g1 = alloc((size_t)D * 2), l.g2 = alloc((size_t)D * 2);
        int32_t meta[32];
        for (int i = 0; i < 16; i++) meta[i] = 100 + i, meta[16 + i] = i;  // positions, slots
        float inv_freq[64];
        for (int i = 0; i < 64; i++) inv_freq[i] = powf(500000.0f, -i / 64.0f);
        int32_t *dmeta = alloc(sizeof meta);
        float *dinv = alloc(sizeof inv_freq);
        pd_backend_upload(g_b, dmeta, meta, sizeof meta);
        pd_backend_upload(g_b, dinv, inv_freq, sizeof inv_freq);
        pd_backend_sync(g_b);
        l.rope = (pd_rope_kv_params){.qkv = l.qkv, .positions = dmeta, .inv_freq = dinv, .slot_mapping = dmeta + 16,
                                     .k_cache = alloc((size_t)16 * 1024 * 2), .v_cache = alloc((size_t)16 * 1024 * 2),
                                     .n_heads = 32, .n_kv_heads = 8, .head_dim = 128, .attn_scaling = 1.0f};
        pd_op_fill_normal(g_b, l.g1, PD_DTYPE_BF16, D, 7, 1.0f, 0.1f);
        pd_op_fill_normal(g_b, l.g2, PD_DTYPE_BF16, D, 8, 1.0f, 0.1f);
        for (int i = 0; i < 2; i++) {
            l.wqkv[i] = rnd((size_t)NQ * D), l.wo[i] = rnd((size_t)D * D);
            l.wgu[i] = rnd((size_t)2 * F * D), l.wd[i] = rnd((size_t)D * F);
        }
        double bytes = 2.0 * ((double)NQ * D + (double)D * D + 2.0 * F * D + (double)D * F);
        // One part at a time left to its own kernel (PD_CUDA_FUSE_*=0 backends): what each fold saves.
        const char *knob[] = {"PD_CUDA_FUSE_NORM", "PD_CUDA_FUSE_GLU", "PD_CUDA_FUSE_ROPE"};
        pd_backend *part[3];
        setenv("PD_CUDA_SKINNY", "2", 1);
        for (int k = 0; k < 3; k++) {
            setenv(knob[k], "0", 1);
            part[k] = pd_backend_new("cuda", 0, &err);
            unsetenv(knob[k]);
            if (!part[k]) { fprintf(stderr, "no cuda: %s\n", err.msg); return 1; }
        }
        // fusev: verify-sized steps (M = k + 1 at batch 1): the default unfused path (rule), the
        // CUDA-core fused layer, and the fused forms on the tensor-core kernel, single- and
        // double-buffered (PD_CUDA_FUSE_MMA_MIN_M=1 [PD_CUDA_SKINNY_MMA_PIPE=1]).
        if (want("fusev")) {
            setenv("PD_CUDA_SKINNY", "1", 1);
            setenv("PD_CUDA_FUSE_MMA_MIN_M", "1", 1);
            pd_backend *fm1 = pd_backend_new("cuda", 0, &err);
            setenv("PD_CUDA_SKINNY_MMA_PIPE", "1", 1);
            pd_backend *fm2 = pd_backend_new("cuda", 0, &err);
            setenv("PD_CUDA_FUSE_MMA_FORMS", "1", 1);  // the qkv GEMM alone there (pipe), the rest on CUDA cores
            pd_backend *fmq = pd_backend_new("cuda", 0, &err);
            unsetenv("PD_CUDA_FUSE_MMA_FORMS");
            unsetenv("PD_CUDA_SKINNY_MMA_PIPE");
            setenv("PD_CUDA_SKINNY_MMA_LOADS", "32", 1);  // single-buffered, 32 loads in flight per thread
            pd_backend *fm3 = pd_backend_new("cuda", 0, &err);
            unsetenv("PD_CUDA_SKINNY_MMA_LOADS");
            unsetenv("PD_CUDA_FUSE_MMA_MIN_M");
            setenv("PD_CUDA_SKINNY", "2", 1);
            setenv("PD_CUDA_SKINNY_MMA", "0", 1);
            setenv("PD_CUDA_FUSE_NORM_MAX_M", "8", 1);  // the CUDA-core kernel with the norm folded
            pd_backend *fcn = pd_backend_new("cuda", 0, &err);
            unsetenv("PD_CUDA_FUSE_NORM_MAX_M");
            setenv("PD_CUDA_SKINNY_OCC4", "1", 1);  // its 128-register build at M = 5
            pd_backend *fc4 = pd_backend_new("cuda", 0, &err);
            unsetenv("PD_CUDA_SKINNY_OCC4");
            setenv("PD_CUDA_SKINNY_ASYNC", "1", 1);  // its weights through shared memory
            pd_backend *fca = pd_backend_new("cuda", 0, &err);
            unsetenv("PD_CUDA_SKINNY_ASYNC");
            unsetenv("PD_CUDA_SKINNY_MMA");
            if (!fm1 || !fm2 || !fcn || !fmq || !fm3 || !fc4 || !fca) { fprintf(stderr, "no cuda: %s\n", err.msg); return 1; }
            double floor_us = isnan(copy_gbs) ? NAN : bytes / (copy_gbs * 1e3);
            int vm[] = {1, 2, 4, 5, 6, 8, 9, 12, 16};
            for (int mi = 0; mi < 9; mi++) {
                l.M = vm[mi];
                l.fused = false;
                double t_r = time_us(rule, ly_op, &l, 100);
                double t_lt = time_us(g_b, ly_op, &l, 100);
                l.fused = true;
                double t_c = l.M <= 8 ? time_us(sk, ly_op, &l, 100) : NAN;
                double t_cn = l.M <= 8 ? time_us(fcn, ly_op, &l, 100) : NAN;
                double t_c4 = l.M == 5 ? time_us(fc4, ly_op, &l, 100) : NAN;
                double t_ca = l.M <= 8 ? time_us(fca, ly_op, &l, 100) : NAN;
                double t_m1 = time_us(fm1, ly_op, &l, 100), t_m2 = time_us(fm2, ly_op, &l, 100);
                double t_mq = time_us(fmq, ly_op, &l, 100), t_m3 = time_us(fm3, ly_op, &l, 100);
                printf("fusev layer M=%-2d  unfused rule %6.1f us  unfused cublasLt %6.1f  fused cores %6.1f  fused cores "
                       "norm-in %6.1f  fused cores occ4 %6.1f  fused cores async %6.1f  fused mma %6.1f  fused mma pipe "
                       "%6.1f  fused mma 32 loads %6.1f  qkv on mma pipe, rest cores %6.1f  (floor at the copy rate %.1f us)\n",
                       l.M, t_r, t_lt, t_c, t_cn, t_c4, t_ca, t_m1, t_m2, t_m3, t_mq, floor_us);
            }
            if (!want("fuse")) goto fuse_done;
        }
        int fm[] = {1, 2, 4, 8};
        for (int mi = 0; mi < 4; mi++) {
            l.M = fm[mi];
            l.fused = false;
            double t_u = time_us(sk, ly_op, &l, 100);
            l.fused = true;
            double t_f = time_us(sk, ly_op, &l, 100), t_p[3];
            for (int k = 0; k < 3; k++) t_p[k] = time_us(part[k], ly_op, &l, 100);
            double floor_us = isnan(copy_gbs) ? NAN : bytes / (copy_gbs * 1e3);
            printf("fuse layer M=%d  unfused %7.1f us (8 kernels)  fused %7.1f us (4 kernels)  saved %5.1f us/layer "
                   "= %5.3f ms/token (32 layers); weights %.0f MB, floor at the copy rate %.1f us (fused %.0f%%)\n",
                   l.M, t_u, t_f, t_u - t_f, 32 * (t_u - t_f) / 1e3, bytes / 1e6, floor_us, 100 * floor_us / t_f);
            printf("fuse parts M=%d  fused but norm unfused %7.1f us, silu_mul unfused %7.1f us, rope unfused %7.1f us "
                   "(each vs fused %.1f us)\n", l.M, t_p[0], t_p[1], t_p[2], t_f);
        }
    }
fuse_done:
    // attention: Llama-3-8B heads
    int H = 32, Hkv = 8, hd = 128;
    int pre[] = {512, 2048, 8192};
    // OP_BENCH_ATTNPRE_L=512|2048|8192: attnpre runs only the one-sequence cases of that length (both head dims)
    const char *only_s = getenv("OP_BENCH_ATTNPRE_L");
    int only = only_s && *only_s ? atoi(only_s) : 0;
    if (only_s && *only_s && only != 512 && only != 2048 && only != 8192) {
        fprintf(stderr, "OP_BENCH_ATTNPRE_L=%s: expected 512, 2048 or 8192\n", only_s);
        return 2;
    }
    // OP_BENCH_ATTNPRE_REPS=n: n timed calls per case (default 5 at 8192 tokens, 20 below), e.g. to
    // sample the clock and power under a sustained run
    const char *reps_s = getenv("OP_BENCH_ATTNPRE_REPS");
    int reps_env = reps_s && *reps_s ? atoi(reps_s) : 0;
    if (reps_s && *reps_s && (reps_env < 1 || reps_env > 100000)) {
        fprintf(stderr, "OP_BENCH_ATTNPRE_REPS=%s: expected 1..100000\n", reps_s);
        return 2;
    }
    for (int f8 = 0; f8 < 2; f8++)
        for (int i = 0; i < 3 && (want("prefill") || (want("attnpre") && !f8)); i++) {
            if (only && pre[i] != only) continue;
            at_arg a;
            attn_setup(&a, 1, pre[i], pre[i], H, Hkv, hd, 16, f8);
            us = time_us(g_b, at_op, &a, reps_env ? reps_env : pre[i] == 8192 ? 5 : 20);
            double fl = 4.0 * H * hd * (double)pre[i] * pre[i] / 2;
            printf("attn prefill %s L=%-5d    %9.1f us  %6.1f TFLOP/s (causal flops)\n", f8 ? "fp8 " : "bf16", pre[i], us,
                   fl / (us * 1e6));
        }
    // attnpre: also head_dim 64 (32 heads, 8 kv heads) at 512 / 2048 / 8192 and 4 prompts of 2048 in one batch
    for (int i = 0; i < 4 && want("attnpre"); i++) {
        at_arg a;
        int n_seqs = i == 3 ? 4 : 1, L = i == 0 ? 512 : i == 2 ? 8192 : 2048, d = i == 3 ? 128 : 64;
        if (only && (n_seqs > 1 || L != only)) continue;
        attn_setup(&a, n_seqs, L, L, H, Hkv, d, 16, false);
        us = time_us(g_b, at_op, &a, reps_env ? reps_env : L * n_seqs >= 8192 ? 5 : 20);
        double fl = 4.0 * H * d * (double)L * L / 2 * n_seqs;
        printf("attn prefill bf16 hd=%d %dx L=%-5d %9.1f us  %6.1f TFLOP/s (causal flops)\n", d, n_seqs, L, us,
               fl / (us * 1e6));
    }
    int dec[16][2] = {{1, 128}, {1, 4096}, {1, 8192}, {1, 32768}, {64, 128}, {64, 512}, {64, 4096}, {256, 1024},
                      {8, 32768}, {32, 32768}};
    int n_dec = 10;
    // OP_BENCH_ATTN="B:CTX,B:CTX,...": these decode cases instead (e.g. one case under a profiler)
    const char *cases = getenv("OP_BENCH_ATTN");
    if (cases && *cases) {
        n_dec = 0;
        for (const char *c = cases; *c && n_dec < 16;) {
            int bb, cc, used = 0;
            if (sscanf(c, "%d:%d%n", &bb, &cc, &used) != 2 || bb < 1 || bb > 1024 || cc < 1 || cc > (1 << 20)) {
                fprintf(stderr, "OP_BENCH_ATTN=%s: expected B:CTX[,B:CTX...]\n", cases);
                return 2;
            }
            dec[n_dec][0] = bb, dec[n_dec][1] = cc, n_dec++;
            c += used;
            if (*c == ',') c++;
            else if (*c) {
                fprintf(stderr, "OP_BENCH_ATTN=%s: expected B:CTX[,B:CTX...]\n", cases);
                return 2;
            }
        }
    }
    for (int i = 0; i < n_dec && want("attn"); i++)
        for (int f8 = 0; f8 < 2; f8++) {
            at_arg a;
            attn_setup(&a, dec[i][0], 1, dec[i][1], H, Hkv, hd, 16, f8);
            us = time_us(g_b, at_op, &a, 50);
            // bytes read: every K and V row of the context (fp8: e4m3 values + the per-head scales)
            double row = f8 ? (double)Hkv * (hd + 4) : (double)Hkv * hd * 2;
            double bytes = (double)dec[i][0] * dec[i][1] * row * 2;
            printf("attn decode %s B=%-4d ctx=%-6d %9.1f us  %6.0f GB/s (KV bytes read)\n", f8 ? "fp8 " : "bf16",
                   dec[i][0], dec[i][1], us, bytes / (us * 1e3));
        }
    if (want("step")) {  // cuBLASLt (+ silu_mul) first, then the batched-decode GEMM (PD_CUDA_BGEMM=0: only the first)
        pd_backend *bes[2] = {g_b, bg};
        const char *bn[2] = {"cublasLt", "bgemm"};
        bench_step(copy_gbs, bes, bn, bg_on ? 2 : 1);
    }
    if (want("single")) {  // the default rule (fused M = 1 forms); OPB_SINGLE_VARIANTS adds PD_CUDA_* variants
        pd_backend *bes[6] = {rule};
        const char *bn[6] = {"rule"};
        int n_be = 1;
        // OPB_SINGLE_VARIANTS="NAME=VALUE[+NAME=VALUE...],...": one more backend per entry, built with
        // those env knobs on top of the default rule (e.g. PD_CUDA_SKINNY_ASYNC=1: a knob the CUDA
        // backend reads when created)
        const char *vv = getenv("OPB_SINGLE_VARIANTS");
        static char vnames[5][64];
        for (const char *c = vv; c && *c && n_be < 6;) {
            const char *e = strchr(c, ',');
            size_t n = e ? (size_t)(e - c) : strlen(c);
            char kv[256];
            if (n >= sizeof kv || !memchr(c, '=', n)) { fprintf(stderr, "OPB_SINGLE_VARIANTS: NAME=VALUE[+NAME=VALUE][,...]\n"); return 2; }
            memcpy(kv, c, n), kv[n] = 0;
            char *names[8];
            int n_kv = 0;
            setenv("PD_CUDA_SKINNY", "1", 1);
            for (char *t = kv; t && n_kv < 8;) {
                char *plus = strchr(t, '+'), *eq = strchr(t, '=');
                if (plus) *plus = 0;
                if (!eq || (plus && eq > plus)) { fprintf(stderr, "OPB_SINGLE_VARIANTS: NAME=VALUE[+NAME=VALUE][,...]\n"); return 2; }
                *eq = 0;
                setenv(t, eq + 1, 1);
                printf("single backend v%d: %s=%s\n", n_be, t, eq + 1);
                names[n_kv++] = t;
                t = plus ? plus + 1 : NULL;
            }
            bes[n_be] = pd_backend_new("cuda", 0, &err);
            for (int i = 0; i < n_kv; i++) unsetenv(names[i]);
            if (!bes[n_be]) { fprintf(stderr, "no cuda: %s\n", err.msg); return 1; }
            snprintf(vnames[n_be - 1], sizeof vnames[0], "v%d", n_be);
            bn[n_be] = vnames[n_be - 1];
            n_be++;
            c = e ? e + 1 : c + n;
        }
        bench_single(copy_gbs, bes, bn, n_be);
    }
    if (want("sample")) bench_sample();
    if (g_argc >= 2 && want("pfl")) bench_pfl();  // only when asked for
    return 0;
}
