// fa3_probe.c — a diagnosable correctness probe of the CUDA prefill attention kernel(s) against
// a double-precision CPU reference, through the kernels' C interface (pd_cuda_attention). For a
// failing case it prints a map of the largest error per (8 query rows x 8 head dims) cell of the
// first query tile, so a layout bug (swizzle, descriptor, fragment order) shows as a pattern.
// Usage: fa3_probe   (PD_CUDA_ATTN_PREFILL=0 selects the old kernel, as in the engine; FA3_PROBE_PAGES=contig:
// consecutive pages instead of scattered ones)
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.cuh"

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint64_t rng = 88172645463325252ull;
static float urand(void) {  // uniform in [-1, 1)
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.f - 1.f;
}

#define CK(x)                                                                             \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
            exit(2);                                                                      \
        }                                                                                 \
    } while (0)

typedef struct pcase {
    const char *name;
    int H, Hkv, hd, bs, n_seqs;
    int q_lens[4], kv_lens[4];
    int mode;  // 0 random; 1 Q = 0 (S = 0: tests P.V and the mask alone); 2 V row j = e_(j mod hd) (O = P)
} pcase;

static int run_case(const pcase *c) {
    int n_tok = 0, n_bt = 0, max_q = 0, max_kv = 0, qi[5] = {0}, bi[5] = {0};
    for (int s = 0; s < c->n_seqs; s++) {
        n_tok += c->q_lens[s];
        qi[s + 1] = n_tok;
        n_bt += (c->kv_lens[s] + c->bs - 1) / c->bs;
        bi[s + 1] = n_bt;
        if (c->q_lens[s] > max_q) max_q = c->q_lens[s];
        if (c->kv_lens[s] > max_kv) max_kv = c->kv_lens[s];
    }
    int n_blocks = n_bt + 2, hd = c->hd, H = c->H, Hkv = c->Hkv;
    int32_t *bt = malloc(4 * (size_t)n_bt);
    // scattered, all distinct; FA3_PROBE_PAGES=contig: consecutive from page 1 (the TMA producer's
    // whole-tile boxes)
    const char *pages = getenv("FA3_PROBE_PAGES");
    bool contig = pages && !strcmp(pages, "contig");
    for (int i = 0; i < n_bt; i++) bt[i] = contig ? i + 1 : (int32_t)(((int64_t)i * 7 + 1) % n_blocks);
    size_t kvn = (size_t)n_blocks * c->bs * Hkv * hd, qn = (size_t)n_tok * H * hd;
    uint16_t *q = malloc(2 * qn), *k = malloc(2 * kvn), *v = malloc(2 * kvn), *o = malloc(2 * qn);
    for (size_t i = 0; i < qn; i++) q[i] = f2bf(c->mode == 1 ? 0.f : urand() * 2.f);
    for (size_t i = 0; i < kvn; i++) k[i] = f2bf(urand() * 2.f), v[i] = f2bf(urand());
    if (c->mode == 2)  // logical position j of every sequence: V = e_(j mod hd)
        for (int s = 0; s < c->n_seqs; s++)
            for (int j = 0; j < c->kv_lens[s]; j++) {
                size_t slot = (size_t)bt[bi[s] + j / c->bs] * c->bs + j % c->bs;
                for (int kvh = 0; kvh < Hkv; kvh++)
                    for (int e = 0; e < hd; e++) v[(slot * Hkv + kvh) * hd + e] = f2bf(e == j % hd ? 1.f : 0.f);
            }
    void *dq, *dk, *dv, *dout;
    int32_t *dqi, *dkl, *dbi, *dbt;
    CK(cudaMalloc(&dq, 2 * qn));
    CK(cudaMalloc(&dk, 2 * kvn));
    CK(cudaMalloc(&dv, 2 * kvn));
    CK(cudaMalloc(&dout, 2 * qn));
    CK(cudaMalloc((void **)&dqi, 4 * 5));
    CK(cudaMalloc((void **)&dkl, 4 * 4));
    CK(cudaMalloc((void **)&dbi, 4 * 5));
    CK(cudaMalloc((void **)&dbt, 4 * (size_t)n_bt));
    CK(cudaMemcpy(dq, q, 2 * qn, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k, 2 * kvn, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, v, 2 * kvn, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout, 0xff, 2 * qn));  // NaN: rows the kernel misses show
    CK(cudaMemcpy(dqi, qi, 4 * 5, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dkl, c->kv_lens, 4 * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dbi, bi, 4 * 5, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dbt, bt, 4 * (size_t)n_bt, cudaMemcpyHostToDevice));
    size_t wsb = pd_cuda_attention_workspace_bytes(n_tok, c->n_seqs, H, Hkv, hd, max_kv);
    size_t cnb = pd_cuda_attention_counter_bytes(c->n_seqs, Hkv, hd, max_kv);
    void *ws = NULL, *cnt = NULL;
    if (wsb) CK(cudaMalloc(&ws, wsb));
    if (cnb) {
        CK(cudaMalloc(&cnt, cnb));
        CK(cudaMemset(cnt, 0, cnb));
    }
    pd_attention_kparams p = {.q = dq, .k_cache = dk, .v_cache = dv, .out = dout, .q_indptr = dqi, .kv_lens = dkl,
                              .bt_indptr = dbi, .bt_indices = dbt, .n_tokens = n_tok, .n_seqs = c->n_seqs,
                              .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd, .block_size = c->bs,
                              .q_stride = H * hd, .max_q_len = max_q, .max_kv_len = max_kv,
                              .scale = 1.f / sqrtf((float)hd), .workspace = ws, .workspace_bytes = wsb,
                              .counters = cnt};
    pd_cuda_attention(&p, 0);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(o, dout, 2 * qn, cudaMemcpyDeviceToHost));

    double max_err = 0, sum_e2 = 0, sum_r2 = 0;
    int bad_row = -1, bad_h = -1, bad_d = -1;
    float cell[16][16];  // first 128-row tile of sequence 0, head 0: max error per 8x8 cell
    memset(cell, 0, sizeof cell);
    double *sc = malloc(sizeof(double) * (size_t)max_kv), *acc = malloc(sizeof(double) * (size_t)hd);
    for (int s = 0; s < c->n_seqs; s++) {
        int ql = c->q_lens[s], kl = c->kv_lens[s];
        for (int i = 0; i < ql; i++) {
            int pos = kl - ql + i, tok = qi[s] + i;
            for (int h = 0; h < H; h++) {
                int kvh = h / (H / Hkv);
                double mx = -1e300;
                for (int j = 0; j <= pos; j++) {
                    size_t slot = (size_t)bt[bi[s] + j / c->bs] * c->bs + j % c->bs;
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += (double)bf2f(q[(size_t)tok * H * hd + h * hd + e]) *
                             bf2f(k[(slot * Hkv + kvh) * hd + e]);
                    sc[j] = d / sqrt((double)hd);
                    if (sc[j] > mx) mx = sc[j];
                }
                double den = 0;
                for (int e = 0; e < hd; e++) acc[e] = 0;
                for (int j = 0; j <= pos; j++) {
                    double w = exp(sc[j] - mx);
                    den += w;
                    size_t slot = (size_t)bt[bi[s] + j / c->bs] * c->bs + j % c->bs;
                    for (int e = 0; e < hd; e++) acc[e] += w * bf2f(v[(slot * Hkv + kvh) * hd + e]);
                }
                for (int e = 0; e < hd; e++) {
                    double ref = acc[e] / den, got = bf2f(o[(size_t)tok * H * hd + h * hd + e]);
                    double err = fabs(got - ref);
                    if (got != got) err = 1e30;
                    sum_e2 += (got - ref) * (got - ref) * (got == got), sum_r2 += ref * ref;
                    if (err > max_err) max_err = err, bad_row = tok, bad_h = h, bad_d = e;
                    if (s == 0 && h == 0 && i < 128 && e < 128 && err > cell[i / 8][e / 8]) cell[i / 8][e / 8] = (float)err;
                }
            }
        }
    }
    double nmse = sum_r2 > 0 ? sum_e2 / sum_r2 : 0;
    int ok = max_err < 0.03 && nmse < 1e-4;
    printf("%-4s %-28s%s H=%d Hkv=%d hd=%d bs=%d seqs=%d: max abs err %.4g (token %d head %d dim %d) nmse %.3g\n",
           ok ? "OK" : "FAIL", c->name, c->mode == 1 ? " [Q=0]" : c->mode == 2 ? " [V=I]" : "", H, Hkv, hd, c->bs, c->n_seqs, max_err, bad_row, bad_h, bad_d, nmse);
    if (!ok) {
        printf("  max error per 8 rows (down) x 8 dims (across), sequence 0 head 0, first 128 rows ('.' < 0.03, "
               "'x' NaN/huge):\n");
        int rows = c->q_lens[0] < 128 ? (c->q_lens[0] + 7) / 8 : 16, cols = hd / 8 < 16 ? hd / 8 : 16;
        for (int r = 0; r < rows; r++) {
            printf("  ");
            for (int d = 0; d < cols; d++) {
                float e = cell[r][d];
                printf("%c", e < 0.03f ? '.' : e > 1e20f ? 'x' : e < 0.1f ? '1' : e < 0.3f ? '2' : e < 1.f ? '3' : '#');
            }
            printf("\n");
        }
    }
    free(sc), free(acc), free(q), free(k), free(v), free(o), free(bt);
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout), cudaFree(dqi), cudaFree(dkl), cudaFree(dbi);
    cudaFree(dbt), cudaFree(ws), cudaFree(cnt);
    return ok;
}

int main(void) {
    const pcase cases[] = {
        {"one tile 128", 1, 1, 128, 16, 1, {128}, {128}, 1},
        {"one tile 128", 1, 1, 64, 16, 1, {128}, {128}, 1},
        {"one tile 128", 1, 1, 128, 16, 1, {128}, {128}, 2},
        {"one tile 128", 1, 1, 64, 16, 1, {64}, {64}, 2},
        {"one tile 128", 1, 1, 128, 16, 1, {128}, {128}},
        {"one tile 128", 1, 1, 64, 16, 1, {128}, {128}},
        {"kv only 64 rows", 1, 1, 128, 16, 1, {64}, {64}},
        {"two q tiles, 3 kv tiles", 4, 2, 128, 16, 1, {300}, {300}},
        {"two q tiles, 3 kv tiles", 4, 2, 64, 16, 1, {300}, {300}},
        {"prefix 800 + chunk 200, bs 7", 8, 2, 128, 7, 1, {200}, {1000}},
        {"prefix, bs 1", 4, 1, 64, 1, 1, {77}, {333}},
        {"mixed batch", 8, 8, 128, 16, 4, {1, 129, 2, 65}, {50, 129, 700, 400}},
        {"mixed batch", 4, 2, 64, 32, 4, {250, 1, 17, 3}, {250, 90, 17, 1024}},
        {"long 2048", 2, 1, 128, 16, 1, {2048}, {2048}},
    };
    int n_ok = 0, n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) n_ok += run_case(&cases[i]);
    printf("fa3_probe: %d/%d cases OK\n", n_ok, n);
    return n_ok == n ? 0 : 1;
}
