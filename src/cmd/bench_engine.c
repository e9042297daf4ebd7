// bench_engine.c — `pdserve bench-engine`: how close the model runtime runs to the card's limits.
//
// First it measures the two ceilings of the device through the backend: copy bandwidth (a
// device-to-device copy of 1 GiB, counting bytes read + written) and bf16 GEMM peak (8192^3).
// Then, on the model (usually --load-format dummy with a real config), it times
//   * single-stream decode at contexts --ctx (default 128, 4096, 8192, 32768; ms per token), and
//     the same step enqueued 20 times back to back with one sync ("pipelined": the device's time
//     per step; the difference is what the host adds: upload, graph launch, wait),
//   * one decode step at batch --batches (default 1, 8, 32, 64, 128, 256), context --batch-ctx
//     (default 512),
//   * prefill of 512, 2048 and 8192 tokens (one sequence, one step),
// each next to its floor: decode = (weight bytes read + KV bytes read) / bandwidth; prefill =
// (2 * matmul params * tokens + causal attention FLOPs counted once) / GEMM peak. Weight bytes
// are counted as a step reads them (llama-bench's accounting): every matrix and norm, one
// embedding row per token, not the embedding table (unless tied: then it is read as lm_head).
// Every floor is given twice: from the measured ceiling and from the card's datasheet (a table
// of known cards by device name, or --datasheet-gbs / --datasheet-tflops); the ratio time /
// floor and the share of each ceiling are printed and written with --json FILE.
//
// Each group of experiments gets a KV cache sized for it alone (single-stream: one sequence of
// the longest --ctx; batched: the largest batch x --batch-ctx; prefill: 8192), filled with random values, so a
// long single-stream context never needs a pool for 256 sequences. --kv-cache-dtype fp8 runs the
// same experiments on the E4M3 cache (backend.h, PD_KV_FP8); its KV bytes are the fp8 rows.
//
// --only decode|prefill|single runs one part (the ceilings are measured unless only verify runs).
//
// --verify-tokens N (speculative decoding): times verify steps of 1..N tokens per sequence (the
// last token + N-1 drafts, logits at every row, as the engine's verify forward asks) at batch 1,
// 8, 32, 64, context --batch-ctx, next to the plain decode step, and prints the speedup this
// implies at acceptance 0.5..0.9 with a draft costing 1/10 of a plain step per token (a 1/10-size
// draft on a memory-bound step): E(k) = (1 - a^(k+1)) / (1 - a) tokens per verify of k drafts,
// speedup = E(k) * t(1) / (t(k+1) + k * t(1) / 10), best k shown.
//
// Timing: host clock around pd_model_forward_dev + pd_backend_sync per step, median of several
// steps after warm-up; launches are not captured in a graph (see docs: the forward pass uploads
// its metadata each step), so the decode numbers include host launch overhead where it shows.
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "cmd/cmd.h"
#include "model/model.h"

typedef struct bench_ctx {
    pd_backend *be;
    pd_model *m;
    pd_model_cache *kc;
    const pd_model_config *c;
    int block_size, n_blocks;
    double copy_bytes_s, gemm_flop_s, gemm_sus, gemm_lo, gemm_hi;  // gemm: peak, sustained median, slowest, fastest round
    int gemm_rounds;
    double ds_bytes_s, ds_flop_s;  // datasheet (0: unknown card)
    bool prof_on;                  // PD_CUDA_PROF=1
    int prefill_idle_ms;           // --prefill-idle-ms
    int idle_ms;                   // serial steps: the device idles this long before each (--prefill-idle-ms)
    const char *prof;              // non-NULL: serial steps end with one profiled step titled so (PD_CUDA_PROF)
    json_t *out;
} bench_ctx;

// Datasheet HBM bandwidth and dense bf16 tensor rate of known cards, matched on the device name
// (the SXM parts unless the name says otherwise). Leads, not measurements: bench-engine reports
// its floors against both these and the ceilings it measures.
static const struct {
    const char *name_has;
    double gbs, tflops;
} datasheet[] = {
    {"H200", 4800, 989},        {"H100 NVL", 3900, 835}, {"H100 PCIe", 2000, 756}, {"H100", 3350, 989},
    {"H800", 3350, 989},        {"GH200", 4000, 989},    {"A100 80GB PCIe", 1935, 312},
    {"A100-SXM4-80GB", 2039, 312}, {"A100", 1555, 312},  {"L40S", 864, 362},       {"L4", 300, 121},
};

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- device ceilings ---------------------------------------------------------------------------

// Two independent 1 GiB device-to-device copies per call (k and v point at different halves of
// one 4 GiB buffer, so neither L2 nor write merging can shortcut the second copy).
static double measure_copy(pd_backend *be) {
    size_t n = (size_t)1 << 30;
    pd_buffer *buf = pd_buffer_alloc(be, 4 * n);
    if (!buf) return 0;
    pd_op_fill_normal(be, pd_buffer_ptr(buf), PD_DTYPE_F32, n, 1, 0.0f, 1.0f);  // never time on zeros
    void *kc[1] = {pd_buffer_ptr(buf)}, *vc[1] = {(char *)pd_buffer_ptr(buf) + 2 * n};
    int32_t src = 0, dst = 1;
    pd_copy_blocks_params p = {.k_caches = kc, .v_caches = vc, .src_blocks = &src, .dst_blocks = &dst,
                               .n = 1, .n_layers = 1, .block_bytes = n};
    double t[7];
    for (int i = 0; i < 9; i++) {
        int64_t t0 = pd_time_us();
        pd_op_copy_blocks(be, &p);
        pd_backend_sync(be);
        if (i >= 2) t[i - 2] = (double)(pd_time_us() - t0) * 1e-6;
    }
    pd_buffer_free(buf);
    return 2.0 * 2.0 * (double)n / median(t, 7);  // 2 copies x (read + write)
}

// The bf16 GEMM peak: 8192^3, 2 warm-up rounds then timed rounds of 5 GEMMs. The peak (the floor's
// reference, as in every earlier session's figures) is the median of the first 5 timed rounds
// (~35 ms); the rounds go on until 0.3 s have passed (at most GEMM_ROUNDS: 40 on an H100, as long
// as an 8192-token prefill) and their median is printed as the sustained rate, with the slowest and
// fastest round: on an H100 the power limit pulls a sustained 8192^3 GEMM on random data from
// ~790 to ~710 TFLOP/s within those 0.3 s (session 12: rounds 651-798). Floors stay on the short
// peak, the higher reference.
#define GEMM_ROUNDS 40
static double measure_gemm(pd_backend *be, double *sustained, double *lo, double *hi, int *rounds) {
    const int n = 8192;
    size_t e = pd_dtype_size(pd_backend_act_dtype(be)), sz = (size_t)n * n;
    pd_buffer *a = pd_buffer_alloc(be, sz * e), *w = pd_buffer_alloc(be, sz * e), *o = pd_buffer_alloc(be, sz * e);
    double r = 0;
    *sustained = *lo = *hi = 0;
    *rounds = 0;
    if (a && w && o) {
        pd_op_fill_normal(be, pd_buffer_ptr(a), pd_backend_act_dtype(be), sz, 2, 0.0f, 1.0f);
        pd_op_fill_normal(be, pd_buffer_ptr(w), pd_backend_weight_dtype(be), sz, 3, 0.0f, 0.02f);
        pd_matmul_params p = {.a = pd_buffer_ptr(a), .w = pd_buffer_ptr(w), .out = pd_buffer_ptr(o), .M = n, .N = n, .K = n};
        double t[GEMM_ROUNDS], first[5], spent = 0;
        int nt = 0;
        for (int i = 0; nt < GEMM_ROUNDS && (nt < 5 || spent < 0.3); i++) {
            int64_t t0 = pd_time_us();
            for (int k = 0; k < 5; k++) pd_op_matmul(be, &p);
            pd_backend_sync(be);
            double dt = (double)(pd_time_us() - t0) * 1e-6;
            if (i >= 2) t[nt++] = dt / 5, spent += dt;
        }
        memcpy(first, t, sizeof first);
        double fl = 2.0 * n * (double)n * n, tmin = t[0], tmax = t[0];
        for (int i = 1; i < nt; i++) tmin = t[i] < tmin ? t[i] : tmin, tmax = t[i] > tmax ? t[i] : tmax;
        *hi = fl / tmin;
        *lo = fl / tmax;
        *rounds = nt;
        *sustained = fl / median(t, nt);
        r = fl / median(first, 5);
    }
    pd_buffer_free(a);
    pd_buffer_free(w);
    pd_buffer_free(o);
    return r;
}

// ---- model steps -------------------------------------------------------------------------------

static double matmul_params(const pd_model_config *c) {
    double D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim;
    double per_layer = D * (c->n_heads + 2.0 * c->n_kv_heads) * hd + c->n_heads * hd * D + 3.0 * F * D;
    return per_layer * c->n_layers;
}
static double kv_bytes_per_token(bench_ctx *b) { return 2.0 * b->c->n_layers * (double)pd_model_kv_row_bytes(b->m); }

// Replaces the KV cache with one of n_blocks blocks of random contents (never time on zeros; an
// fp8 cache gets random e4m3 values and finite scales). false when it does not fit.
static bool cache_resize(bench_ctx *b, long n_blocks) {
    pd_model_cache_free(b->kc);
    b->kc = NULL;
    b->n_blocks = 0;
    if (n_blocks > INT32_MAX) return false;
    pd_err err = {0};
    b->kc = pd_model_cache_new(b->m, (int)n_blocks, b->block_size, &err);
    if (!b->kc) {
        fprintf(stderr, "bench-engine: KV cache of %ld blocks: %s\n", n_blocks, err.msg);
        return false;
    }
    b->n_blocks = (int)n_blocks;
    pd_buffer *kvb = pd_model_cache_buffer(b->kc);
    pd_dtype dt = pd_model_kv_dtype(b->m) == PD_KV_FP8 ? PD_DTYPE_FP8_E4M3 : pd_backend_act_dtype(b->be);
    pd_op_fill_normal(b->be, pd_buffer_ptr(kvb), dt, pd_buffer_size(kvb) / pd_dtype_size(dt), 9, 0.0f, 1.0f);
    return true;
}

// Times one step of n_seqs sequences, each with q_len new tokens on top of ctx - q_len cached
// ones (blocks handed out in order); logits for the last row of each sequence. Median seconds.
// pipelined: the steps are enqueued back to back with one sync at the end (mean seconds): the
// device's time per step without the host's launch and wait between steps.
// call_us (may be NULL): the median time the forward call itself took on the host in the serial
// steps (padding, metadata, upload and graph launch: what the host spends before the device runs).
static double time_step_rows(bench_ctx *b, int n_seqs, int q_len, int ctx, int reps, bool all_rows, bool pipelined,
                             double *call_us) {
    int bps = (ctx + b->block_size - 1) / b->block_size, T = n_seqs * q_len;
    if ((long)n_seqs * bps > b->n_blocks) return NAN;
    int32_t *tok = pd_malloc(sizeof(int32_t) * (size_t)T), *qi = pd_malloc(sizeof(int32_t) * (size_t)(n_seqs + 1));
    int32_t *kv = pd_malloc(sizeof(int32_t) * (size_t)n_seqs), *bi = pd_malloc(sizeof(int32_t) * (size_t)(n_seqs + 1));
    int n_rows = all_rows ? T : n_seqs;
    int32_t *bt = pd_malloc(sizeof(int32_t) * (size_t)n_seqs * bps), *rows = pd_malloc(sizeof(int32_t) * (size_t)n_rows);
    pd_rng r;
    pd_rng_seed(&r, 5);
    for (int i = 0; i < T; i++) tok[i] = (int32_t)(pd_rng_next(&r) % (uint64_t)b->c->vocab_size);
    for (int s = 0; s <= n_seqs; s++) {
        qi[s] = s * q_len;
        bi[s] = s * bps;
    }
    for (int s = 0; s < n_seqs; s++) {
        kv[s] = ctx;
        if (!all_rows) rows[s] = (s + 1) * q_len - 1;
    }
    for (int i = 0; all_rows && i < T; i++) rows[i] = i;
    for (int i = 0; i < n_seqs * bps; i++) bt[i] = i;
    pd_batch batch = {.n_tokens = T, .tokens = tok, .n_seqs = n_seqs, .q_indptr = qi, .kv_lens = kv, .bt_indptr = bi,
                      .bt_indices = bt, .n_logits = n_rows, .logit_rows = rows};
    double t[32];
    if (reps > 32) reps = 32;
    const float *dl;
    if (pipelined) {  // reps steps enqueued back to back, one sync: the device's time per step
        for (int i = 0; i < reps + 2; i++) {
            if (i == 2) {
                pd_backend_sync(b->be);
                t[0] = (double)pd_time_us();
            }
            pd_status st = pd_model_forward_dev(b->m, b->kc, &batch, &dl);
            if (st) {
                fprintf(stderr, "bench-engine: forward failed: %s\n", pd_status_str(st));
                reps = 0;
                break;
            }
        }
        pd_backend_sync(b->be);
        double per = reps ? ((double)pd_time_us() - t[0]) * 1e-6 / reps : NAN;
        pd_free(tok), pd_free(qi), pd_free(kv), pd_free(bi), pd_free(bt), pd_free(rows);
        return per;
    }
    double tc[32];
    for (int i = 0; i < reps + 2; i++) {
        if (b->idle_ms > 0) nanosleep(&(struct timespec){.tv_sec = b->idle_ms / 1000, .tv_nsec = b->idle_ms % 1000 * 1000000L}, NULL);
        int64_t t0 = pd_time_us();
        pd_status st = pd_model_forward_dev(b->m, b->kc, &batch, &dl);
        int64_t t1 = pd_time_us();
        pd_backend_sync(b->be);
        if (st) {
            fprintf(stderr, "bench-engine: forward failed: %s\n", pd_status_str(st));
            reps = 0;
            break;
        }
        if (i >= 2) t[i - 2] = (double)(pd_time_us() - t0) * 1e-6, tc[i - 2] = (double)(t1 - t0);
    }
    // PD_CUDA_PROF=1: the same step twice more with the op profiler (backend.h), after the timed
    // ones so its events never touch a timed figure; the first only warms the profiler's events.
    for (int k = 0; b->prof && reps && k < 2; k++) {
        if (b->idle_ms > 0) nanosleep(&(struct timespec){.tv_sec = b->idle_ms / 1000, .tv_nsec = b->idle_ms % 1000 * 1000000L}, NULL);
        if (!pd_backend_prof_begin(b->be)) {
            printf("prof: this backend has no device events\n");
            break;
        }
        int64_t t0 = pd_time_us();
        pd_status st = pd_model_forward_dev(b->m, b->kc, &batch, &dl);
        int64_t t1 = pd_time_us();
        pd_backend_sync(b->be);
        int64_t t2 = pd_time_us();
        pd_backend_prof_end(b->be, k ? stdout : NULL, b->prof);
        if (k && !st)
            printf("prof %s: this step %.1f us (forward call %.1f us, then the sync); the timed median %.1f us\n", b->prof,
                   (double)(t2 - t0), (double)(t1 - t0), median(t, reps) * 1e6);
    }
    pd_free(tok), pd_free(qi), pd_free(kv), pd_free(bi), pd_free(bt), pd_free(rows);
    if (call_us) *call_us = reps ? median(tc, reps) : NAN;
    return reps ? median(t, reps) : NAN;
}

static double time_step(bench_ctx *b, int n_seqs, int q_len, int ctx, int reps) {
    return time_step_rows(b, n_seqs, q_len, ctx, reps, false, false, NULL);
}

// d: a draft model's bench (NULL: none); its 1-token step is timed at each batch size too.
#define BENCH_MAX_CTX 16

// vb: the batch sizes (n_vb of them; NULL: 1, 8, 32, 64).
static void run_verify(bench_ctx *b, bench_ctx *d, int batch_ctx, int max_q, const int *vb, int n_vb) {
    int batches[BENCH_MAX_CTX] = {1, 8, 32, 64}, n_b = 4;
    if (vb) {
        n_b = n_vb;
        for (int i = 0; i < n_vb; i++) batches[i] = vb[i];
    }
    // Verify steps of up to max_q tokens per sequence run from CUDA graphs, as in the engine
    // (PD_CUDA_GRAPHS=0: eagerly); each (batch, tokens) shape is captured in the untimed steps.
    pd_model_set_graph_q(b->m, max_q);
    if (!cache_resize(b, 64L * ((batch_ctx + b->block_size - 1) / b->block_size))) return;
    if (d && !cache_resize(d, 64L * ((batch_ctx + d->block_size - 1) / d->block_size))) d = NULL;
    double alphas[] = {0.5, 0.6, 0.7, 0.8, 0.9};
    json_t *arr = json_array();
    for (int bi = 0; bi < n_b; bi++) {
        int B = batches[bi];
        double t[17] = {0}, td = NAN;
        for (int q = 1; q <= max_q; q++) {
            t[q] = time_step_rows(b, B, q, batch_ctx, 10, true, false, NULL);
            printf("%-22s batch=%-3d ctx=%-5d tokens/seq=%d %10.3f ms  (%.2fx the 1-token step)\n", "verify step", B, batch_ctx, q,
                   t[q] * 1e3, t[q] / t[1]);
            json_array_append_new(arr, json_pack("{s:i, s:i, s:i, s:f}", "batch", B, "ctx", batch_ctx, "tokens_per_seq", q, "ms", t[q] * 1e3));
        }
        if (d) {
            td = time_step_rows(d, B, 1, batch_ctx, 10, false, false, NULL);
            printf("%-22s batch=%-3d ctx=%-5d %10.3f ms  (%.3fx the target's 1-token step)\n", "draft step", B, batch_ctx, td * 1e3,
                   td / t[1]);
            json_array_append_new(arr, json_pack("{s:i, s:i, s:f, s:f}", "batch", B, "ctx", batch_ctx, "draft_ms", td * 1e3,
                                                 "draft_ratio", td / t[1]));
        }
        for (size_t ai = 0; ai < PD_ARRAY_LEN(alphas); ai++) {
            // cost of k drafts: k / 10 plain steps (the 1/10-size draft), or k measured draft steps
            for (int model = 0; model < (d ? 2 : 1); model++) {
                double a = alphas[ai], best = 1, dc = model == 0 ? t[1] / 10.0 : td;
                int best_k = 0;
                for (int k = 1; k + 1 <= max_q; k++) {
                    double E = (1 - pow(a, k + 1)) / (1 - a);
                    double sp = E * t[1] / (t[k + 1] + k * dc);
                    if (sp > best) best = sp, best_k = k;
                }
                printf("%-22s batch=%-3d acceptance %.1f: best k=%d drafts, implied speedup %.2fx (%s)\n", "", B, a, best_k, best,
                       model == 0 ? "draft = 1/10 of a step" : "measured draft step");
                json_array_append_new(arr, json_pack("{s:i, s:f, s:i, s:f, s:s}", "batch", B, "acceptance", a, "best_k", best_k,
                                                     "speedup", best, "draft_cost", model == 0 ? "tenth" : "measured"));
            }
        }
    }
    json_object_set_new(b->out, "verify", arr);
}

// work: bytes (floor "bw") or FLOPs (floor "gemm") the step must move / compute.
static void report(bench_ctx *b, const char *kind, const char *label, int batch, int tokens, int ctx, double sec,
                   double work, const char *floor_kind) {
    bool bw = !strcmp(floor_kind, "bw");
    double ceil = bw ? b->copy_bytes_s : b->gemm_flop_s, ds = bw ? b->ds_bytes_s : b->ds_flop_s;
    double floor_sec = work / ceil, ds_floor = ds > 0 ? work / ds : NAN;
    double ratio = sec / floor_sec;
    printf("%-22s %-18s %10.3f ms  floor %8.3f ms (%s) %5.2fx = %3.0f%%", kind, label, sec * 1e3, floor_sec * 1e3,
           floor_kind, ratio, 100.0 / ratio);
    if (ds > 0) printf("  datasheet %8.3f ms %5.2fx = %3.0f%%", ds_floor * 1e3, sec / ds_floor, 100.0 * ds_floor / sec);
    if (bw) printf("  %.2f GB, %4.0f GB/s", work * 1e-9, work / sec * 1e-9);
    else printf("  %5.1f TFLOP/s", work / sec * 1e-12);
    // GEMM floors: the share of the sustained median too (the short peak is a cool card's burst;
    // back-to-back steps run at the power limit, as the sustained rounds do)
    if (!bw && b->gemm_sus > 0) printf(" = %.1f%% of the sustained %.1f", 100.0 * work / sec / b->gemm_sus, b->gemm_sus * 1e-12);
    printf("\n");
    json_t *r = json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:f, s:f, s:s, s:f}", "kind", kind, "label", label, "batch",
                          batch, "tokens", tokens, "ctx", ctx, "ms", sec * 1e3, "floor_ms", floor_sec * 1e3, "ratio",
                          ratio, "floor", floor_kind, bw ? "bytes" : "flops", work);
    if (ds > 0) {
        json_object_set_new(r, "datasheet_floor_ms", json_real(ds_floor * 1e3));
        json_object_set_new(r, "datasheet_ratio", json_real(sec / ds_floor));
    }
    if (bw) json_object_set_new(r, "tok_s", json_real(tokens / sec));
    if (!bw && b->gemm_sus > 0) json_object_set_new(r, "sustained_ratio", json_real(work / sec / b->gemm_sus));
    json_array_append_new(json_object_get(b->out, "results"), r);
}


static void run_benchmarks(bench_ctx *b, const int *ctxs, int n_ctx, const int *batches, int n_batches,
                           int batch_ctx, bool single, bool batched, bool prefill) {
    double kvpt = kv_bytes_per_token(b);
    int bs = b->block_size, max_ctx = 0;
    for (int i = 0; i < n_ctx; i++) max_ctx = PD_MAX(max_ctx, ctxs[i]);
    if (single && n_ctx > 0 && cache_resize(b, (max_ctx + bs - 1) / bs)) {
        for (int i = 0; i < n_ctx; i++) {
            double call_us;
            double t = time_step_rows(b, 1, 1, ctxs[i], 20, false, false, &call_us);
            char label[64];
            snprintf(label, sizeof label, "ctx=%d", ctxs[i]);
            report(b, "decode single-stream", label, 1, 1, ctxs[i], t,
                   (double)pd_model_weight_bytes_read(b->m, 1) + kvpt * ctxs[i], "bw");
            // The same step enqueued back to back: what the host adds between steps (metadata
            // upload, graph launch, the wait) is the difference.
            double tp = time_step_rows(b, 1, 1, ctxs[i], 20, false, true, NULL);
            printf("%-22s %-18s %10.3f ms  (back to back, one sync: the host adds %.1f us a step; the forward call %.1f us)\n",
                   "  pipelined", label, tp * 1e3, (t - tp) * 1e6, call_us);
            json_t *res = json_object_get(b->out, "results");
            json_object_set_new(json_array_get(res, json_array_size(res) - 1), "pipelined_ms", json_real(tp * 1e3));
        }
    }
    int max_batch = 0;
    for (int i = 0; i < n_batches; i++) max_batch = PD_MAX(max_batch, batches[i]);
    if (batched && n_batches > 0 && cache_resize(b, (long)max_batch * ((batch_ctx + bs - 1) / bs))) {
        for (int i = 0; i < n_batches; i++) {
            double t = time_step(b, batches[i], 1, batch_ctx, 10);
            char label[64];
            snprintf(label, sizeof label, "batch=%d ctx=%d", batches[i], batch_ctx);
            report(b, "decode step", label, batches[i], batches[i], batch_ctx, t,
                   (double)pd_model_weight_bytes_read(b->m, batches[i]) + kvpt * batch_ctx * batches[i], "bw");
        }
    }
    int lens[] = {512, 2048, 8192};
    const pd_model_config *c = b->c;
    // PD_CUDA_PROF=1: each prefill length ends with one step under the op profiler (backend.h
    // pd_backend_prof_begin): per op and shape its device time, the idle time before it, the host's
    // time in the call, and the host's work before the first op: where a prefill's time goes.
    bool prof = b->prof_on;
    if (prefill && cache_resize(b, (8192 + bs - 1) / bs)) {
        for (int i = 0; i < 3; i++) {
            double L = lens[i];
            double flops = 2.0 * matmul_params(c) * L + 2.0 * c->vocab_size * c->hidden_size +
                           c->n_layers * 2.0 * 2.0 * c->n_heads * c->head_dim * (L * (L + 1) / 2);
            char label[64];
            snprintf(label, sizeof label, "tokens=%d", lens[i]);
            b->prof = prof ? label : NULL;
            b->idle_ms = b->prefill_idle_ms;
            double t = time_step(b, 1, lens[i], lens[i], lens[i] >= 8192 ? 3 : 5);
            b->prof = NULL;
            b->idle_ms = 0;
            report(b, "prefill", label, 1, lens[i], lens[i], t, flops, "gemm");
        }
    }
}

int pd_cmd_bench_engine(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},   {"load-format", required_argument, 0, 'l'},
                                         {"json", required_argument, 0, 'j'},    {"device", required_argument, 0, 'd'},
                                         {"batch-ctx", required_argument, 0, 'c'}, {"only", required_argument, 0, 'o'},
                                         {"ctx", required_argument, 0, 'x'},     {"kv-cache-dtype", required_argument, 0, 'k'},
                                         {"datasheet-gbs", required_argument, 0, 'g'},
                                         {"datasheet-tflops", required_argument, 0, 't'},
                                         {"batches", required_argument, 0, 'b'},
                                         {"verify-tokens", required_argument, 0, 'v'},
                                         {"draft-model", required_argument, 0, 'D'},
                                         {"prefill-idle-ms", required_argument, 0, 'I'},
                                         {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    const char *model = NULL, *json_path = NULL, *device = "auto", *draft_dir = NULL;
    bool dummy = false, single = true, batched = true, prefill = true;
    long batch_ctx = 512, verify_tokens = 0;
    int ctxs[BENCH_MAX_CTX] = {128, 4096, 8192, 32768}, n_ctx = 4;
    int batches[BENCH_MAX_CTX] = {1, 8, 32, 64, 128, 256}, n_batches = 6;
    bool batches_set = false;  // --batches given: also the verify steps' batch sizes (at most 64)
    pd_kv_dtype kv_dtype = PD_KV_ACT;
    double ds_gbs = 0, ds_tflops = 0;
    long idle_ms = 0;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'l':
            if (strcmp(optarg, "dummy") && strcmp(optarg, "auto"))
                return pd_cmd_usage_error("bench-engine", "--load-format is auto or dummy");
            dummy = !strcmp(optarg, "dummy");
            break;
        case 'j': json_path = optarg; break;
        case 'D': draft_dir = optarg; break;
        case 'd': device = optarg; break;
        case 'c':
            if (!pd_cmd_parse_int(optarg, &batch_ctx) || batch_ctx < 1 || batch_ctx > 1 << 20)
                return pd_cmd_usage_error("bench-engine", "--batch-ctx must be a positive integer");
            break;
        case 'o':
            if (!strcmp(optarg, "decode")) prefill = false;
            else if (!strcmp(optarg, "prefill")) single = batched = false;
            else if (!strcmp(optarg, "single")) batched = prefill = false;
            else if (!strcmp(optarg, "verify")) single = batched = prefill = false;
            else if (strcmp(optarg, "all"))
                return pd_cmd_usage_error("bench-engine", "--only is decode, single, prefill, verify or all");
            break;
        case 'v':
            if (!pd_cmd_parse_int(optarg, &verify_tokens) || verify_tokens < 1 || verify_tokens > 16)
                return pd_cmd_usage_error("bench-engine", "--verify-tokens must be 1..16");
            break;
        case 'x':
        case 'b': {
            if (c == 'b') batches_set = true;
            int *dst = c == 'x' ? ctxs : batches, *n = c == 'x' ? &n_ctx : &n_batches;
            *n = 0;
            char *save = NULL, *list = strdup(optarg);
            if (!list) return 1;
            for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                long v;
                if (*n == BENCH_MAX_CTX || !pd_cmd_parse_int(tok, &v) || v < 1 || v > 1 << 20) {
                    free(list);
                    return pd_cmd_usage_error("bench-engine", "--ctx / --batches take a list of up to %d numbers in "
                                              "[1, 1048576]", BENCH_MAX_CTX);
                }
                dst[(*n)++] = (int)v;
            }
            free(list);
            break;
        }
        case 'I':
            if (!pd_cmd_parse_int(optarg, &idle_ms) || idle_ms < 0 || idle_ms > 10000)
                return pd_cmd_usage_error("bench-engine", "--prefill-idle-ms must be 0..10000");
            break;
        case 'k':
            if (!pd_kv_dtype_parse(optarg, &kv_dtype))
                return pd_cmd_usage_error("bench-engine", "--kv-cache-dtype is auto or fp8, not '%s'", optarg);
            break;
        case 'g':
        case 't': {
            char *end;
            double v = strtod(optarg, &end);
            if (*end || !(v > 0)) return pd_cmd_usage_error("bench-engine", "--datasheet-gbs/-tflops take a positive number");
            *(c == 'g' ? &ds_gbs : &ds_tflops) = v;
            break;
        }
        case 'h':
            printf("usage: pdserve bench-engine --model DIR [--load-format dummy|auto] [--device auto|cuda|cpu]\n"
                   "                            [--ctx N,N,...] [--batches N,N,...] [--batch-ctx N]\n"
                   "                            [--only decode|single|prefill|verify|all] [--verify-tokens N]\n"
                   "                            [--kv-cache-dtype auto|fp8] [--datasheet-gbs X] [--datasheet-tflops X]\n"
                   "                            [--prefill-idle-ms N] [--json FILE]\n"
                   "  --verify-tokens N   speculative verify steps of 1..N tokens per sequence at batch 1/8/32/64\n"
                   "                      (or at the --batches given, each at most 64)\n"
                   "                      (--only verify runs just those)\n"
                   "  --draft-model DIR   with --verify-tokens: also time this draft's 1-token step (same load format)\n"
                   "                      and give the implied speedup with it\n"
                   "  --prefill-idle-ms N each prefill step starts after the device idled N ms (0: back to back, the\n"
                   "                      default): the card's clocks recover from its power limit between steps,\n"
                   "                      as before the short GEMM peak (a diagnostic, not the floor's figure)\n"
                   "environment: PD_CUDA_PROF=1 ends each prefill length with one step under the op profiler\n"
                   "             (a table per op and shape: device time, idle time, host time)\n");
            return 0;
        default: return 2;
        }
    }
    if (!model) return pd_cmd_usage_error("bench-engine", "--model DIR is required");
    for (int i = 0; verify_tokens > 0 && batches_set && i < n_batches; i++)
        if (batches[i] > 64) return pd_cmd_usage_error("bench-engine", "--batches with --verify-tokens: each at most 64");
    pd_err err = {0};
    bench_ctx b = {.block_size = 16}, d = {.block_size = 16};
    b.prefill_idle_ms = (int)idle_ms;
    if (pd_env_switch("PD_CUDA_PROF", false, &b.prof_on, &err)) {
        fprintf(stderr, "pdserve bench-engine: %s\n", err.msg);
        return 2;
    }
    b.be = pd_backend_new(device, 0, &err);
    if (!b.be) {
        fprintf(stderr, "pdserve bench-engine: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    if (single || batched || prefill) {  // the floors need them; verify steps are compared with each other
        b.copy_bytes_s = measure_copy(b.be);
        b.gemm_flop_s = measure_gemm(b.be, &b.gemm_sus, &b.gemm_lo, &b.gemm_hi, &b.gemm_rounds);
        // The CUDA backend's prefill tuning (gemm.c gemm_tune_pf, opt-in) would tune the 8192^3 peak
        // GEMM too, and measured it lower (session 11): the % of that floor is then no reference.
        const char *tpf = getenv("PD_CUDA_GEMM_TUNE_PF");
        if (tpf && *tpf && strcmp(tpf, "0"))
            printf("note: PD_CUDA_GEMM_TUNE_PF=%s tunes the 8192^3 peak GEMM too: compare prefill ms against a run "
                   "without it, not the %% of this floor\n", tpf);
    }
    const char *dev_name = pd_backend_device_name(b.be);
    for (size_t i = 0; i < sizeof datasheet / sizeof datasheet[0] && strcmp(pd_backend_name(b.be), "cpu"); i++)
        if (strstr(dev_name, datasheet[i].name_has)) {
            b.ds_bytes_s = datasheet[i].gbs * 1e9;
            b.ds_flop_s = datasheet[i].tflops * 1e12;
            break;
        }
    if (ds_gbs > 0) b.ds_bytes_s = ds_gbs * 1e9;
    if (ds_tflops > 0) b.ds_flop_s = ds_tflops * 1e12;
    printf("device %s (%s): copy %.0f GB/s (read+write, 1 GiB), bf16 GEMM 8192^3 %.1f TFLOP/s (sustained over %d "
           "rounds %.1f, rounds %.1f-%.1f)", pd_backend_name(b.be), dev_name, b.copy_bytes_s * 1e-9, b.gemm_flop_s * 1e-12,
           b.gemm_rounds, b.gemm_sus * 1e-12, b.gemm_lo * 1e-12, b.gemm_hi * 1e-12);
    if (b.ds_bytes_s > 0)
        printf("; datasheet %.0f GB/s, %.0f TFLOP/s (copy = %.0f%%, GEMM = %.0f%% of it)", b.ds_bytes_s * 1e-9,
               b.ds_flop_s * 1e-12, 100.0 * b.copy_bytes_s / b.ds_bytes_s, 100.0 * b.gemm_flop_s / b.ds_flop_s);
    printf("\n");
    pd_model_params mp = pd_model_params_default();
    mp.dir = model;
    mp.backend = b.be;
    mp.dummy = dummy;
    mp.seed = 1;
    mp.kv_dtype = kv_dtype;
    b.m = pd_model_load(&mp, &err);
    if (!b.m) {
        fprintf(stderr, "pdserve bench-engine: %s\n", err.msg);
        goto done;
    }
    b.c = pd_model_get_config(b.m);
    printf("model %s: %d layers, D=%d, F=%d, heads %d/%d x %d, vocab %d, weights %.2f GB (%.2f GB read per "
           "token), KV %s, %.0f bytes per token\n",
           model, b.c->n_layers, b.c->hidden_size, b.c->intermediate_size, b.c->n_heads, b.c->n_kv_heads, b.c->head_dim,
           b.c->vocab_size, (double)pd_model_weight_bytes(b.m) * 1e-9, (double)pd_model_weight_bytes_read(b.m, 1) * 1e-9,
           pd_kv_dtype_name(kv_dtype), kv_bytes_per_token(&b));
    b.out = json_pack("{s:s, s:s, s:s, s:s, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:[]}", "model", model, "device",
                      pd_backend_name(b.be), "device_name", dev_name, "kv_cache_dtype", pd_kv_dtype_name(kv_dtype),
                      "copy_gbs", b.copy_bytes_s * 1e-9, "gemm_tflops", b.gemm_flop_s * 1e-12, "gemm_tflops_sustained", b.gemm_sus * 1e-12, "gemm_tflops_min",
                      b.gemm_lo * 1e-12, "gemm_tflops_max", b.gemm_hi * 1e-12, "datasheet_gbs",
                      b.ds_bytes_s * 1e-9, "datasheet_tflops", b.ds_flop_s * 1e-12, "weight_gb",
                      (double)pd_model_weight_bytes(b.m) * 1e-9, "kv_bytes_per_token", kv_bytes_per_token(&b), "results");
    run_benchmarks(&b, ctxs, n_ctx, batches, n_batches, (int)batch_ctx, single, batched, prefill);
    d.be = b.be;
    if (verify_tokens > 0 && draft_dir) {
        pd_model_params dp = mp;
        dp.dir = draft_dir;
        dp.seed = 2;
        d.m = pd_model_load(&dp, &err);
        if (!d.m) {
            fprintf(stderr, "pdserve bench-engine: draft: %s\n", err.msg);
            goto done;
        }
        d.c = pd_model_get_config(d.m);
        printf("draft %s: %d layers, D=%d, weights %.2f GB (%.2f GB read per token, %.3f of the target's)\n", draft_dir,
               d.c->n_layers, d.c->hidden_size, (double)pd_model_weight_bytes(d.m) * 1e-9,
               (double)pd_model_weight_bytes_read(d.m, 1) * 1e-9,
               (double)pd_model_weight_bytes_read(d.m, 1) / (double)pd_model_weight_bytes_read(b.m, 1));
    }
    if (verify_tokens > 0) run_verify(&b, d.m ? &d : NULL, (int)batch_ctx, (int)verify_tokens, batches_set ? batches : NULL, n_batches);
    else if (!single && !batched && !prefill) fprintf(stderr, "bench-engine: --only verify needs --verify-tokens N\n");
    if (json_path && json_dump_file(b.out, json_path, JSON_INDENT(2)) != 0) {
        fprintf(stderr, "pdserve bench-engine: cannot write %s\n", json_path);
        goto done;
    }
    rc = 0;
done:
    json_decref(b.out);
    if (d.kc) pd_model_cache_free(d.kc);
    if (d.m) pd_model_free(d.m);
    pd_model_cache_free(b.kc);
    pd_model_free(b.m);
    pd_backend_free(b.be);
    return rc;
}
