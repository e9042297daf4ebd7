// sample_prof.cu — where the sampling kernel's time goes at small batch (issue 17 item 1): the
// kernel of src/kernels/sample.cu compiled with PD_SAMPLE_PROF, whose first CTA's thread 0 adds the
// SM clocks between marks into g_sprof[] (slots: the SPROF() marks in sample.cu). Logits like
// op_bench's (normal(0, 2.5), 8 tokens lifted by 12..5), rows in the launch parameters, results
// in device memory. Per case: host-timed launch + synchronize (median of N), then the mean clocks
// of each slot converted at the device's clock rate (cudaDevAttrClockRate, the boost clock: the
// conversion is approximate), and for top-p the tokens of the one-read path against the
// candidate-set path's over the same draws (same survivors; a difference needs u * S within
// rounding of a boundary). Build: tools/gpu/build_sample_prof.sh; run: sample_prof [V] [batch].
#define PD_SAMPLE_PROF 1
#include "kernels/sample.cu"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double urand(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return ((double)(g_rng >> 11) + 0.5) / 9007199254740992.0;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct pcase {
    const char *name;
    float t, p, min_p;
    int k, topp2;  // topp2: PD_CUDA_SAMPLE_TOPP2 (1 on, 0 off)
    const char *gather, *cl;  // PD_CUDA_SAMPLE_GATHER, PD_CUDA_SAMPLE_CLUSTER ("0": the launch's choice)
};

int main(int argc, char **argv) {
    int V = argc > 1 ? atoi(argv[1]) : 128256, B = argc > 2 ? atoi(argv[2]) : 1, N = 300;
    if (V < 1024 || B < 1 || B > PD_SAMPLE_KINLINE) {
        fprintf(stderr, "usage: sample_prof [V >= 1024] [batch 1..%d]\n", PD_SAMPLE_KINLINE);
        return 2;
    }
    float *h = (float *)malloc(sizeof(float) * (size_t)V * B);
    for (size_t i = 0; i < (size_t)V * B; i++) {
        double u1 = urand(), u2 = urand();
        h[i] = (float)(2.5 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    for (int r = 0; r < B; r++)
        for (int j = 0; j < 8; j++) h[(size_t)r * V + (size_t)(j * 7919 + r * 31) % V] += 12.0f - j;
    float *d;
    pd_sample_kout *out;
    CK(cudaMalloc(&d, sizeof(float) * (size_t)V * B));
    CK(cudaMalloc(&out, sizeof(pd_sample_kout) * B));
    CK(cudaMemcpy(d, h, sizeof(float) * (size_t)V * B, cudaMemcpyHostToDevice));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    static const pcase cases[] = {
        {"greedy", 0, 1, 0, 0, 1, "1", "0"},
        {"temperature 0.8", 0.8f, 1, 0, 0, 1, "1", "0"},
        {"top-k 40, full gather (GATHER=0)", 1, 1, 0, 40, 1, "0", "0"},
        {"top-k 40", 1, 1, 0, 40, 1, "1", "0"},
        {"top-k 40 + top-p 0.95", 1, 0.95f, 0, 40, 1, "1", "0"},
        {"top-p 0.9 session 8 (TOPP2=0 GATHER=0)", 1, 0.9f, 0, 0, 0, "0", "0"},
        {"top-p 0.9 cand-set (TOPP2=0)", 1, 0.9f, 0, 0, 0, "1", "0"},
        {"top-p 0.9 one-read", 1, 0.9f, 0, 0, 1, "1", "0"},
        {"top-p 0.9 one-read, full gather", 1, 0.9f, 0, 0, 1, "0", "0"},
        {"top-p 0.95 cand-set (TOPP2=0)", 1, 0.95f, 0, 0, 0, "1", "0"},
        {"top-p 0.95 one-read", 1, 0.95f, 0, 0, 1, "1", "0"},
        {"top-p 0.9 + min-p 0.05 cand-set", 1, 0.9f, 0.05f, 0, 0, "1", "0"},
        {"top-p 0.9 + min-p 0.05 one-read", 1, 0.9f, 0.05f, 0, 1, "1", "0"},
        {"top-p 0.9 one-read, cluster 8", 1, 0.9f, 0, 0, 1, "1", "8"},
    };
    int ncase = (int)(sizeof cases / sizeof cases[0]);
    static int toks[16][512];
    printf("sample_prof V=%d batch=%d, %d launches a case, clock %.0f MHz (boost; slot us approximate)\n", V, B, N,
           khz / 1e3);
    for (int c = 0; c < ncase; c++) {
        const pcase *pc = &cases[c];
        setenv("PD_CUDA_SAMPLE_TOPP2", pc->topp2 ? "1" : "0", 1);
        setenv("PD_CUDA_SAMPLE_CLUSTER", pc->cl, 1);
        setenv("PD_CUDA_SAMPLE_GATHER", pc->gather, 1);
        pd_sample_kinline in;
        memset(&in, 0, sizeof in);
        for (int r = 0; r < B; r++) {
            pd_sample_krow *k = &in.rows[r];
            k->is_greedy = pc->t == 0;
            k->inv_temp = pc->t == 0 ? 1.0f : 1.0f / pc->t;
            k->top_p = pc->p;
            k->top_k = pc->k;
            k->log_min_p = pc->min_p > 0 ? logf(pc->min_p) : -INFINITY;
            k->repetition = 1.0f;
            k->n_logprobs = -1;
            k->mask_row = -1;
            k->seed = 1234 + (uint64_t)r;
        }
        pd_sample_kparams kp;
        memset(&kp, 0, sizeof kp);
        kp.logits = d, kp.out = out, kp.n_rows = B, kp.vocab = V;
        kp.all_greedy = pc->t == 0;
        kp.any_trunc = pc->t != 0 && (pc->k > 0 || pc->p < 1.0f);
        long long zero[32] = {0};
        double us[512];
        for (int it = -20; it < N; it++) {
            if (it == 0) CK(cudaMemcpyToSymbol(g_sprof, zero, sizeof zero));
            for (int r = 0; r < B; r++) in.rows[r].draw_idx = (uint64_t)(it < 0 ? 0 : it);
            double t0 = now_us();
            pd_cuda_sample(&kp, &in, st);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(st));
            double t1 = now_us();
            if (it >= 0) {
                us[it] = t1 - t0;
                pd_sample_kout o;
                CK(cudaMemcpy(&o, out, sizeof o, cudaMemcpyDeviceToHost));
                toks[c][it] = o.token;
            }
        }
        long long prof[32];
        CK(cudaMemcpyFromSymbol(prof, g_sprof, sizeof prof));
        qsort(us, N, sizeof(double), cmp_d);
        printf("%-34s launch+sync median %6.1f us (p10 %.1f, p90 %.1f); slots us:", pc->name, us[N / 2], us[N / 10],
               us[N * 9 / 10]);
        double tot = 0;
        for (int k = 0; k < 32; k++)
            if (prof[k]) {
                double u = (double)prof[k] / N / (khz / 1e3);
                tot += u;
                printf(" %d:%.2f", k, u);
            }
        printf(" | sum %.2f\n", tot);
        for (int q = 0; q < c; q++)
            if (cases[q].t == pc->t && cases[q].p == pc->p && cases[q].min_p == pc->min_p && cases[q].k == pc->k && pc->t != 0) {
                int diff = 0;
                for (int it = 0; it < N; it++) diff += toks[c][it] != toks[q][it];
                printf("%-34s tokens differing from \"%s\": %d of %d\n", "", cases[q].name, diff, N);
                break;
            }
    }
    return 0;
}
