// bench_spec.c — `pdserve bench-spec`: end-to-end decode speed of the engine with speculative
// decoding off, adaptive and fixed-length, at several batch sizes, on one workload.
//
// For each configuration an engine is built (its warm-up captures the decode and verify graphs),
// then for each batch size B, B greedy requests (ignore_eos, --max-tokens each) are submitted at
// once. Decode speed = tokens generated after each request's first token / (last finish - the
// moment the last request got its first token), counting only tokens after that moment: the prefill is left out, the rest is the decode
// loop as a client sees it (drafts, verify, host work). Speculation counters (drafted, accepted,
// emitted, verify steps) are the engine's, as deltas over the batch. Outputs of every
// configuration are compared with speculation off (greedy: equal up to bf16 near-ties on a GPU;
// the count of byte-identical requests is printed).
//
// Workloads (token ids, no tokenizer needed):
//   --golden FILE [--golden-key speculative_acceptance|prompts]: the prompts of a golden file
//   --repeat N: each prompt repeated N times (a repetitive workload for ngram / lookahead)
//   --random-prompt L: one prompt of L seeded random tokens (with --repeat: L random tokens N times)
// Requests cycle through the prompts.
#include <getopt.h>
#include <jansson.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd/cmd.h"
#include "engine/engine.h"
#include "spec/spec.h"

#define MAX_PROMPTS 256
#define MAX_BATCH 256

typedef struct prompts {
    int n;
    int32_t *ids[MAX_PROMPTS];
    int len[MAX_PROMPTS];
} prompts;

typedef struct result {
    double tok_s, wall_s;
    int64_t n_tokens, drafted, accepted, emitted, steps;
    int64_t pos_reached[PD_SPEC_MAX_K], pos_accepted[PD_SPEC_MAX_K];  // per draft position (engine stats)
    int32_t *out;  // (B, max_tokens)
} result;

static bool load_golden(prompts *P, const char *path, const char *key) {
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    if (!g) {
        fprintf(stderr, "bench-spec: %s: %s\n", path, je.text);
        return false;
    }
    json_t *arr = NULL;
    if (!strcmp(key, "speculative_acceptance")) arr = json_object_get(json_object_get(g, key), "per_prompt");
    else arr = json_object_get(g, key);
    if (!json_is_array(arr)) {
        fprintf(stderr, "bench-spec: %s has no %s prompts\n", path, key);
        json_decref(g);
        return false;
    }
    for (size_t i = 0; i < json_array_size(arr) && P->n < MAX_PROMPTS; i++) {
        json_t *it = json_array_get(arr, i);
        json_t *ids = json_is_array(it) ? it : json_object_get(it, "prompt_ids");
        if (!json_is_array(ids)) ids = json_object_get(it, "ids");
        if (!json_is_array(ids) || json_array_size(ids) == 0) continue;
        int n = (int)json_array_size(ids);
        int32_t *v = pd_malloc(sizeof(int32_t) * (size_t)n);
        for (int j = 0; j < n; j++) v[j] = (int32_t)json_integer_value(json_array_get(ids, (size_t)j));
        P->ids[P->n] = v, P->len[P->n++] = n;
    }
    json_decref(g);
    if (!P->n) fprintf(stderr, "bench-spec: no prompt ids under %s in %s\n", key, path);
    return P->n > 0;
}

static void repeat_prompts(prompts *P, int r) {
    for (int i = 0; i < P->n && r > 1; i++) {
        int32_t *v = pd_malloc(sizeof(int32_t) * (size_t)P->len[i] * (size_t)r);
        // A leading BOS (the golden prompts start with one) is kept once.
        for (int k = 0; k < r; k++) memcpy(v + (size_t)k * P->len[i], P->ids[i], sizeof(int32_t) * (size_t)P->len[i]);
        pd_free(P->ids[i]);
        P->ids[i] = v;
        P->len[i] *= r;
    }
}

// Runs B requests on the engine; fills res (out: B x max_tokens tokens).
// B requests at once on prompts first, first + 1, ... (cycling).
static bool run_batch(pd_engine *e, const prompts *P, int B, int first, int max_tokens, result *res) {
    pd_engine_stats s0, s1;
    pd_engine_stats_get(e, &s0);
    int64_t first_max = 0, last = 0, t0 = pd_time_us(), toks_after = 0;  // tokens after the last first token
    int n_out[MAX_BATCH] = {0}, done = 0;
    bool got_first[MAX_BATCH] = {0};
    pd_err err = {0};
    for (int i = 0; i < B; i++) {
        int pi = (first + i) % P->n;
        pd_engine_request q = {.id = (uint64_t)i + 1000, .prompt = P->ids[pi], .n_prompt = P->len[pi],
                               .max_tokens = max_tokens, .ignore_eos = true, .sampling = pd_sampling_params_default()};
        q.sampling.temperature = 0;
        if (pd_engine_submit(e, &q, &err) != PD_OK) {
            fprintf(stderr, "bench-spec: submit: %s\n", err.msg);
            return false;
        }
    }
    int64_t deadline = t0 + 600 * 1000000LL;
    while (done < B && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(e), .events = POLLIN};
        poll(&pfd, 1, 50);
        pd_engine_event ev[256];
        int n;
        while ((n = pd_engine_poll(e, ev, 256)) > 0)
            for (int k = 0; k < n; k++) {
                int i = (int)(ev[k].id - 1000);
                if (i < 0 || i >= B) continue;
                int64_t now = pd_time_us();
                if (ev[k].kind == PD_EV_TOKEN) {
                    if (!got_first[i]) got_first[i] = true, first_max = PD_MAX(first_max, now), toks_after = 0;
                    else toks_after++;
                    if (n_out[i] < max_tokens) res->out[(size_t)i * max_tokens + n_out[i]++] = ev[k].tok.token;
                } else {
                    if (ev[k].finish != PD_ENGINE_FINISH_LENGTH) fprintf(stderr, "bench-spec: request %d finished %d\n", i, ev[k].finish);
                    done++;
                    last = PD_MAX(last, now);
                }
            }
    }
    if (done < B) {
        fprintf(stderr, "bench-spec: %d of %d requests did not finish\n", B - done, B);
        return false;
    }
    pd_engine_stats_get(e, &s1);
    int64_t toks = toks_after;
    res->n_tokens = toks;
    res->wall_s = (double)(last - first_max) * 1e-6;
    res->tok_s = res->wall_s > 0 ? (double)toks / res->wall_s : 0;
    res->drafted = res->accepted = res->emitted = res->steps = 0;
    for (int m = 0; m < 4; m++) {
        res->drafted += s1.spec_drafted[m] - s0.spec_drafted[m];
        res->accepted += s1.spec_accepted[m] - s0.spec_accepted[m];
        res->emitted += s1.spec_emitted[m] - s0.spec_emitted[m];
        res->steps += s1.spec_steps[m] - s0.spec_steps[m];
    }
    for (int j = 0; j < PD_SPEC_MAX_K; j++) {
        res->pos_reached[j] = s1.spec_pos_reached[j] - s0.spec_pos_reached[j];
        res->pos_accepted[j] = s1.spec_pos_accepted[j] - s0.spec_pos_accepted[j];
    }
    return true;
}

// --serial S: one timed run is S batches of B requests one after another, on prompts 0 .. S B - 1
// (cycling): at batch 1, S prompts decoded alone in turn. Tokens, time and counters are summed; the
// outputs of all S B requests are compared with off.
static bool run_serial(pd_engine *e, const prompts *P, int B, int serial, int max_tokens, result *res) {
    result sum = {.out = res->out};
    for (int si = 0; si < serial; si++) {
        result r = {.out = res->out + (size_t)si * (size_t)B * (size_t)max_tokens};
        if (!run_batch(e, P, B, si * B, max_tokens, &r)) return false;
        sum.n_tokens += r.n_tokens, sum.wall_s += r.wall_s, sum.drafted += r.drafted, sum.accepted += r.accepted;
        sum.emitted += r.emitted, sum.steps += r.steps;
        for (int j = 0; j < PD_SPEC_MAX_K; j++) sum.pos_reached[j] += r.pos_reached[j], sum.pos_accepted[j] += r.pos_accepted[j];
    }
    sum.tok_s = sum.wall_s > 0 ? (double)sum.n_tokens / sum.wall_s : 0;
    *res = sum;
    return true;
}

struct opts;
static bool make_copy_prompts(const struct opts *o, prompts *P, pd_engine *e, int copy_len, json_t *wl);

typedef struct opts {
    const char *model, *draft, *golden, *golden_key, *device, *json_path;
    bool dummy, sequential;
    int method, k, repeat, random_len, random_n, max_tokens, max_model_len, reps, serial;
    int dummy_layers, draft_layers, scale_from;  // the controlled-acceptance fixture (0: off; PD_DUMMY_SCALE_ALL: from layer 0)
    float scale_eps;
    double copy_fidelity;  // --copy-chain P (< 0: off)
    int kv_len;  // the longest prompt + max_tokens: the positions a request can hold
    int batches[16], n_batches;
    const char *modes;  // "off,adaptive,fixed" (or METHOD:adaptive, METHOD:fixed)
} opts;

#define MAX_ENGINES 8
#define MAX_REPS 20

// One engine of the comparison: its mode and what each timed run measured.
typedef struct eng {
    int method;  // PD_SPEC_NONE: off
    bool fixed;
    int twin;    // "paused": the speculative engine (index) it times with speculation paused; -1: none
    pd_engine *e;
    double tok_s[16][MAX_REPS];   // [batch][rep]
    int64_t drafted[16], accepted[16], emitted[16], steps[16], tokens[16];  // over the timed reps
    int64_t pos_reached[16][PD_SPEC_MAX_K], pos_accepted[16][PD_SPEC_MAX_K];
    int n_same[16];               // requests of its first timed run equal to the baseline's (-1: not compared)
    int diff_min[16];             // of the others: the earliest first differing token, and the mean
    double diff_mean[16];
} eng;

static const char *eng_mode(const eng *g) {
    return g->twin >= 0 ? "paused" : g->method == PD_SPEC_NONE ? "off" : g->fixed ? "fixed" : "adaptive";
}

// One timed run of an engine (a "paused" entry: its twin's engine with speculation paused).
static bool run_eng(const eng *g, const prompts *P, int B, int serial, int max_tokens, result *res) {
    if (g->twin >= 0) pd_engine_spec_pause(g->e, true);
    bool ok = run_serial(g->e, P, B, serial, max_tokens, res);
    if (g->twin >= 0) pd_engine_spec_pause(g->e, false);
    return ok;
}
static const char *eng_method(const eng *g, const opts *o) {
    return g->method || o->method ? pd_spec_method_name((pd_spec_method)(g->method ? g->method : o->method)) : "-";
}

static pd_engine *make_engine(const opts *o, int spec_method, bool fixed) {
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = o->model;
    p.device = o->device;
    p.dummy_weights = o->dummy;
    p.dummy_num_layers = o->dummy_layers;
    p.dummy_scale_from = o->scale_from;
    p.dummy_scale_eps = o->scale_eps;
    p.max_model_len = o->max_model_len;
    int bmax = 1;
    for (int i = 0; i < o->n_batches; i++) bmax = PD_MAX(bmax, o->batches[i]);
    p.max_num_seqs = bmax;
    // Engines live side by side (interleaved runs): each holds the KV its largest batch needs
    // (the longest prompt + max_tokens + lookahead slots, two blocks of headroom each), not a share
    // of free memory (four Llama-3-8B engines with 1024-token pools for 64 requests did not fit
    // an 80 GB card).
    p.n_blocks = bmax * ((o->kv_len + PD_SPEC_MAX_K + PD_SPEC_MAX_W + 15) / 16 + 2) + 16;
    p.block_size = 16;
    p.spec_method = spec_method;
    p.spec_model_dir = spec_method == PD_SPEC_DRAFT ? o->draft : NULL;
    p.spec_k = o->k;
    p.spec_fixed = fixed;
    p.spec_dummy_num_layers = spec_method == PD_SPEC_DRAFT ? o->draft_layers : 0;
    pd_err err = {0};
    int64_t t0 = pd_time_us();
    pd_engine *e = pd_engine_new(&p, &err);
    if (!e) {
        fprintf(stderr, "bench-spec: engine: %s\n", err.msg);
        return NULL;
    }
    if (pd_engine_start(e) != PD_OK) {
        pd_engine_free(e);
        return NULL;
    }
    printf("engine %-10s %-8s ready in %.1f s (load + warm-up)\n", spec_method ? pd_spec_method_name((pd_spec_method)spec_method) : "off",
           spec_method ? (fixed ? "fixed" : "adaptive") : "", (double)(pd_time_us() - t0) * 1e-6);
    return e;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median_of(const double *v, int n) {
    double t[MAX_BATCH + MAX_ENGINES * MAX_REPS];
    if (n <= 0 || n > (int)PD_ARRAY_LEN(t)) return 0;
    memcpy(t, v, sizeof(double) * (size_t)n);
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

// The workload as the plain engine decodes it: how many outputs end in a cycle (their second half
// repeats with a period <= 64), the median period and where the cycle starts (what prompt lookup
// can predict on random-weight models, whose greedy output falls into loops).
static void describe_outputs(const int32_t *out, int B, int T, json_t *js) {
    int n_cyc = 0, per[MAX_BATCH], from[MAX_BATCH];
    for (int i = 0; i < B; i++) {
        const int32_t *o = out + (size_t)i * T;
        int p = 0;
        for (int c = 1; c <= 64 && c <= T / 2 && !p; c++) {
            bool ok = true;
            for (int t = T / 2; t < T && ok; t++) ok = o[t] == o[t - c];
            if (ok) p = c;
        }
        if (!p) continue;
        int t0 = T / 2;  // the cycle goes back as far as o[t] == o[t - p] holds
        while (t0 - 1 - p >= 0 && o[t0 - 1] == o[t0 - 1 - p]) t0--;
        per[n_cyc] = p, from[n_cyc++] = PD_MAX(t0 - p, 0);
    }
    double dp[MAX_BATCH], df[MAX_BATCH];
    for (int i = 0; i < n_cyc; i++) dp[i] = per[i], df[i] = from[i];
    double mp = n_cyc ? median_of(dp, n_cyc) : 0,
           mf = n_cyc ? median_of(df, n_cyc) : 0;
    printf("workload B=%d: %d/%d plain outputs end in a cycle", B, n_cyc, B);
    if (n_cyc) printf(" (median period %.0f tokens, from token %.0f of %d)", mp, mf, T);
    printf("\n");
    json_object_set_new(js, "outputs_cyclic", json_integer(n_cyc));
    json_object_set_new(js, "cycle_period_median", json_real(mp));
    json_object_set_new(js, "cycle_start_median", json_real(mf));
}

// Timed runs of one batch size over a group of engines that are alive together: each engine gets
// the same untimed warm-up run at this size, then reps rounds in which every engine runs once, the
// order rotated by one each round (A B C, B C A, C A B, ...): no engine is always first, and drift
// over time (clocks, heat, the host) falls on every mode alike.
static bool run_group(const opts *o, const prompts *P, eng *G, int n, int bi, const eng *baseline, int32_t *scratch_out,
                      int32_t **base_out) {
    int B = o->batches[bi];
    for (int j = 0; j < n; j++) {  // (at most 128 tokens: the policy's step shapes get measured)
        result w = {.out = scratch_out};
        if (G[j].twin >= 0) pd_engine_spec_pause(G[j].e, true);
        bool ok = run_batch(G[j].e, P, B, 0, PD_MIN(o->max_tokens, 128), &w);
        if (G[j].twin >= 0) pd_engine_spec_pause(G[j].e, false);
        if (!ok) return false;
    }
    for (int rep = 0; rep < o->reps; rep++)
        for (int jj = 0; jj < n; jj++) {
            eng *g = &G[(rep + jj) % n];
            result r = {.out = scratch_out};
            if (!run_eng(g, P, B, o->serial, o->max_tokens, &r)) return false;
            g->tok_s[bi][rep] = r.tok_s;
            g->drafted[bi] += r.drafted, g->accepted[bi] += r.accepted, g->emitted[bi] += r.emitted;
            g->steps[bi] += r.steps, g->tokens[bi] += r.n_tokens;
            for (int j = 0; j < PD_SPEC_MAX_K; j++)
                g->pos_reached[bi][j] += r.pos_reached[j], g->pos_accepted[bi][j] += r.pos_accepted[j];
            size_t sz = sizeof(int32_t) * (size_t)B * (size_t)o->serial * (size_t)o->max_tokens;
            if (rep == 0 && !*base_out && g == baseline) {
                *base_out = pd_malloc(sz);
                if (!*base_out) return false;
                memcpy(*base_out, r.out, sz);
            }
            if (rep == 0 && g != baseline) {
                // The baseline runs first in round 0 (interleaved) or alone before (sequential).
                g->n_same[bi] = 0;
                g->diff_min[bi] = -1;
                g->diff_mean[bi] = 0;
                int n_diff = 0;
                for (int i = 0; *base_out && i < B * o->serial; i++) {
                    const int32_t *a = r.out + (size_t)i * o->max_tokens, *b = *base_out + (size_t)i * o->max_tokens;
                    int t = 0;
                    while (t < o->max_tokens && a[t] == b[t]) t++;
                    if (t == o->max_tokens) {
                        g->n_same[bi]++;
                        continue;
                    }
                    g->diff_min[bi] = n_diff++ ? PD_MIN(g->diff_min[bi], t) : t;
                    g->diff_mean[bi] += t;
                }
                if (n_diff) g->diff_mean[bi] /= n_diff;
            }
        }
    return true;
}

// --copy-chain P: each prompt p (random tokens) becomes p + g + [p's last token], where g is the
// plain engine's greedy output after p (copy_len tokens) with each token kept with probability P,
// else replaced by another random token (seeded). A target whose next token is a function of the
// last one alone (--dummy-residual-scale 0:0: the hidden state is the token's embedding) then
// decodes the same output again after the new prompt, and prompt lookup finds it in g: every
// draft holds until the first replaced token, so the per-token acceptance is ~P. It is measured,
// not assumed (bf16 near-ties between a decode and a verify GEMM flip a few tokens; a target that
// is not Markov ignores the copy: acceptance ~0).
static bool make_copy_prompts(const opts *o, prompts *P, pd_engine *e, int copy_len, json_t *wl) {
    pd_rng r;
    pd_rng_seed(&r, 23);
    int32_t *out = pd_malloc(sizeof(int32_t) * (size_t)copy_len);
    if (!out) return false;
    int64_t kept = 0, total = 0;
    for (int k = 0; k < P->n; k++) {
        prompts one = {.n = 1, .ids = {P->ids[k]}, .len = {P->len[k]}};
        result res = {.out = out};
        if (!run_batch(e, &one, 1, 0, copy_len, &res)) {
            pd_free(out);
            return false;
        }
        int n = P->len[k] + copy_len + 1;
        int32_t *v = pd_malloc(sizeof(int32_t) * (size_t)n);
        if (!v) {
            pd_free(out);
            return false;
        }
        memcpy(v, P->ids[k], sizeof(int32_t) * (size_t)P->len[k]);
        for (int i = 0; i < copy_len; i++) {
            double u = (double)(pd_rng_next(&r) >> 11) * 0x1.0p-53;
            int32_t t = out[i];
            if (u >= o->copy_fidelity) {
                do t = 1 + (int32_t)(pd_rng_next(&r) % 4000);
                while (t == out[i]);
            } else {
                kept++;
            }
            total++;
            v[P->len[k] + i] = t;
        }
        v[n - 1] = P->ids[k][P->len[k] - 1];
        pd_free(P->ids[k]);
        P->ids[k] = v, P->len[k] = n;
    }
    pd_free(out);
    printf("copy workload: %d prompts of %d tokens (prompt + a copy of the plain output, %lld of %lld tokens kept: %.3f)\n", P->n,
           P->len[0], (long long)kept, (long long)total, total ? (double)kept / (double)total : 0.0);
    json_array_append_new(wl, json_pack("{s:f, s:f}", "copy_fidelity", o->copy_fidelity, "copy_kept", total ? (double)kept / (double)total : 0.0));
    return true;
}

// The a in [0, 1] with 1 + a + ... + a^k = e (bisection; e clamped to [1, k + 1]).
static double implied_alpha(double e, int k) {
    double lo = 0, hi = 1;
    for (int it = 0; it < 60; it++) {
        double a = 0.5 * (lo + hi), t = 1, p = 1;
        for (int j = 1; j <= k; j++) p *= a, t += p;
        if (t < e) lo = a;
        else hi = a;
    }
    return 0.5 * (lo + hi);
}

// Prints (and adds to arr) one batch size's results: per engine the median of its runs and their
// range, the ratio to the plain engines' median (all runs of every off engine pooled), and the
// plain engines' own spread (their noise band): a speculative engine whose median ratio falls
// below the band's low edge is slower than off by more than plain engines differ among themselves.
static void report_batch(const opts *o, eng *G, int n_eng, int bi, json_t *arr, json_t *sums) {
    int B = o->batches[bi], R = o->reps;
    double plain[MAX_ENGINES * MAX_REPS];
    int n_plain = 0, n_plain_eng = 0;
    for (int j = 0; j < n_eng; j++)
        if (G[j].method == PD_SPEC_NONE) {
            n_plain_eng++;
            for (int r = 0; r < R; r++) plain[n_plain++] = G[j].tok_s[bi][r];
        }
    double pm = median_of(plain, n_plain), lo = 1e300, hi = 0;
    for (int i = 0; i < n_plain; i++) lo = PD_MIN(lo, plain[i]), hi = PD_MAX(hi, plain[i]);
    json_t *sum = json_pack("{s:i, s:f, s:f, s:f, s:i, s:i}", "batch", B, "plain_median_tok_s", pm, "plain_band_lo",
                            pm > 0 ? lo / pm : 0.0, "plain_band_hi", pm > 0 ? hi / pm : 0.0, "plain_runs", n_plain,
                            "plain_engines", n_plain_eng);
    for (int j = 0; j < n_eng; j++) {
        eng *g = &G[j];
        double med = median_of(g->tok_s[bi], R), mn = 1e300, mx = 0;
        for (int r = 0; r < R; r++) mn = PD_MIN(mn, g->tok_s[bi][r]), mx = PD_MAX(mx, g->tok_s[bi][r]);
        double acc = g->drafted[bi] ? (double)g->accepted[bi] / (double)g->drafted[bi] : 0;
        double mal = g->steps[bi] ? (double)g->emitted[bi] / (double)g->steps[bi] : 0;
        double ratio = pm > 0 ? med / pm : 0;
        printf("%-10s %-8s batch=%-3d %9.1f tok/s [%.1f..%.1f] %5.2fx off  acceptance %.3f  tokens/verify %.2f  drafted %lld",
               eng_method(g, o), eng_mode(g), B, med, mn, mx, ratio, acc, mal, (long long)(g->drafted[bi] / R));
        // fixed k: the per-token acceptance a of a geometric model that yields these tokens per
        // verify step, E(k) = (1 - a^(k+1)) / (1 - a) (every verify step drafts k for every sequence)
        double ia = g->fixed && mal > 0 ? implied_alpha(mal, o->k) : -1;
        if (ia >= 0) printf("  implied a %.3f", ia);
        // Decode sequence-steps: those that verified (steps) and those that ran plainly (each
        // emitted one of the timed tokens the verify steps did not): the share that drafted.
        int64_t plain_steps = g->tokens[bi] - g->emitted[bi];
        double share = g->steps[bi] + plain_steps > 0 ? (double)g->steps[bi] / (double)(g->steps[bi] + PD_MAX(plain_steps, 0)) : 0;
        json_t *pos = json_array();
        if (g->method != PD_SPEC_NONE) {
            printf("  drafting steps %.3f  per-position", share);
            for (int p = 0; p < PD_SPEC_MAX_K && g->pos_reached[bi][p] > 0; p++) {
                double pa = (double)g->pos_accepted[bi][p] / (double)g->pos_reached[bi][p];
                printf(" %.2f", pa);
                json_array_append_new(pos, json_real(pa));
            }
        }
        if (g->n_same[bi] >= 0) printf("  same as off %d/%d", g->n_same[bi], B * o->serial);
        if (g->n_same[bi] >= 0 && g->diff_min[bi] >= 0)
            printf(" (the others from token %d, mean %.0f)", g->diff_min[bi], g->diff_mean[bi]);
        printf("\n");
        json_t *runs = json_array();
        for (int r = 0; r < R; r++) json_array_append_new(runs, json_real(g->tok_s[bi][r]));
        json_array_append_new(arr, json_pack("{s:s, s:s, s:i, s:i, s:f, s:f, s:f, s:o, s:f, s:f, s:f, s:I, s:I, s:I, s:i}",
                                             "mode", eng_mode(g), "method", eng_method(g, o), "engine", j, "batch", B, "tok_s",
                                             med, "tok_s_min", mn, "tok_s_max", mx, "runs", runs, "speedup", ratio, "acceptance",
                                             acc, "tokens_per_verify", mal, "drafted", (json_int_t)(g->drafted[bi] / R), "accepted",
                                             (json_int_t)(g->accepted[bi] / R), "tokens", (json_int_t)(g->tokens[bi] / R),
                                             "same_as_off", g->n_same[bi]));
        if (ia >= 0) json_object_set_new(json_array_get(arr, json_array_size(arr) - 1), "implied_a", json_real(ia));
        json_object_set_new(json_array_get(arr, json_array_size(arr) - 1), "per_position_acceptance", pos);
        {  // the counts behind it, summed over the timed runs: reached[0] = the verify sequence-steps,
           // sum(accepted) = the accepted drafts
            json_t *last = json_array_get(arr, json_array_size(arr) - 1), *re = json_array(), *ac = json_array();
            for (int p = 0; p < PD_SPEC_MAX_K; p++) {
                json_array_append_new(re, json_integer(g->pos_reached[bi][p]));
                json_array_append_new(ac, json_integer(g->pos_accepted[bi][p]));
            }
            json_object_set_new(last, "pos_reached_total", re);
            json_object_set_new(last, "pos_accepted_total", ac);
            json_object_set_new(last, "verify_steps_total", json_integer(g->steps[bi]));
            json_object_set_new(last, "accepted_total", json_integer(g->accepted[bi]));
        }
        json_object_set_new(json_array_get(arr, json_array_size(arr) - 1), "drafting_step_share", json_real(share));
        if (g->n_same[bi] >= 0 && g->diff_min[bi] >= 0) {
            json_t *last = json_array_get(arr, json_array_size(arr) - 1);
            json_object_set_new(last, "first_diff_min", json_integer(g->diff_min[bi]));
            json_object_set_new(last, "first_diff_mean", json_real(g->diff_mean[bi]));
        }
    }
    printf("summary B=%d: plain %.1f tok/s (median of %d runs, %d engine%s), band [%.3f, %.3f]", B, pm, n_plain, n_plain_eng,
           n_plain_eng == 1 ? "" : "s", pm > 0 ? lo / pm : 0, pm > 0 ? hi / pm : 0);
    json_t *modes = json_array();
    for (int j = 0; j < n_eng; j++) {
        eng *g = &G[j];
        if (g->method == PD_SPEC_NONE) continue;
        double ratio = pm > 0 ? median_of(g->tok_s[bi], R) / pm : 0;
        bool below = ratio < lo / pm, above = ratio > hi / pm;
        printf("; %s %s %.3fx (%s)", eng_method(g, o), eng_mode(g), ratio, below ? "BELOW band" : above ? "above band" : "in band");
        json_array_append_new(modes, json_pack("{s:s, s:s, s:i, s:f, s:b, s:b}", "method", eng_method(g, o), "mode", eng_mode(g),
                                               "engine", j, "ratio", ratio, "below_band", below, "above_band", above));
    }
    // The same engine active against paused: the policy's cost without the engine-to-engine spread.
    // Per round the active run over the paused one (adjacent in time), and their median.
    for (int j = 0; j < n_eng; j++) {
        const eng *p = &G[j];
        if (p->twin < 0) continue;
        const eng *a = &G[p->twin];
        double rr[MAX_REPS];
        printf("; %s %s / paused, engine %d:", eng_method(a, o), eng_mode(a), p->twin);
        for (int r = 0; r < R; r++) rr[r] = p->tok_s[bi][r] > 0 ? a->tok_s[bi][r] / p->tok_s[bi][r] : 0, printf(" %.3f", rr[r]);
        double m = median_of(rr, R);
        printf(" (median %.3fx)", m);
        json_t *pr = json_array();
        for (int r = 0; r < R; r++) json_array_append_new(pr, json_real(rr[r]));
        json_array_append_new(modes, json_pack("{s:s, s:s, s:i, s:f, s:o}", "method", eng_method(a, o), "mode", "active_over_paused",
                                               "engine", p->twin, "ratio", m, "per_round", pr));
    }
    printf("\n");
    fflush(stdout);
    json_object_set_new(sum, "speculative", modes);
    json_array_append_new(sums, sum);
}

int pd_cmd_bench_spec(int argc, char **argv) {
    static const struct option lo[] = {{"model", required_argument, 0, 'm'},       {"load-format", required_argument, 0, 'l'},
                                       {"device", required_argument, 0, 'd'},      {"speculative-method", required_argument, 0, 's'},
                                       {"speculative-model", required_argument, 0, 'D'}, {"num-speculative-tokens", required_argument, 0, 'k'},
                                       {"golden", required_argument, 0, 'g'},      {"golden-key", required_argument, 0, 'G'},
                                       {"repeat", required_argument, 0, 'r'},      {"random-prompt", required_argument, 0, 'R'},
                                       {"random-prompts", required_argument, 0, 'N'},
                                       {"max-tokens", required_argument, 0, 't'},  {"batches", required_argument, 0, 'b'},
                                       {"modes", required_argument, 0, 'M'},       {"max-model-len", required_argument, 0, 'L'},
                                       {"reps", required_argument, 0, 'p'},        {"json", required_argument, 0, 'j'},
                                       {"sequential", no_argument, 0, 'S'},
                                       {"serial", required_argument, 0, 'Q'},
                                       {"dummy-num-layers", required_argument, 0, 'Y'},
                                       {"dummy-residual-scale", required_argument, 0, 'E'},
                                       {"speculative-dummy-layers", required_argument, 0, 'K'},
                                       {"copy-chain", required_argument, 0, 'C'},
                                       {"help", no_argument, 0, 'h'},              {0, 0, 0, 0}};
    opts o = {.device = "auto", .golden_key = "prompts", .k = 4, .repeat = 1, .random_n = 1, .max_tokens = 128,
              .max_model_len = 1024, .reps = 3, .copy_fidelity = -1, .serial = 1, .modes = "off,adaptive,fixed", .batches = {1, 8, 32, 64},
              .n_batches = 4};
    int c;
    long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'm': o.model = optarg; break;
        case 'l':
            if (strcmp(optarg, "dummy") && strcmp(optarg, "auto")) return pd_cmd_usage_error("bench-spec", "--load-format is dummy or auto");
            o.dummy = !strcmp(optarg, "dummy");
            break;
        case 'd': o.device = optarg; break;
        case 's':
            if (!strcmp(optarg, "draft")) o.method = PD_SPEC_DRAFT;
            else if (!strcmp(optarg, "ngram")) o.method = PD_SPEC_NGRAM;
            else if (!strcmp(optarg, "lookahead")) o.method = PD_SPEC_LOOKAHEAD;
            else return pd_cmd_usage_error("bench-spec", "--speculative-method is draft, ngram or lookahead");
            break;
        case 'D': o.draft = optarg; break;
        case 'k':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > PD_SPEC_MAX_K) return pd_cmd_usage_error("bench-spec", "--num-speculative-tokens must be 1..%d", PD_SPEC_MAX_K);
            o.k = (int)v;
            break;
        case 'g': o.golden = optarg; break;
        case 'G': o.golden_key = optarg; break;
        case 'r':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 64) return pd_cmd_usage_error("bench-spec", "--repeat must be 1..64");
            o.repeat = (int)v;
            break;
        case 'R':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 65536) return pd_cmd_usage_error("bench-spec", "--random-prompt must be 1..65536");
            o.random_len = (int)v;
            break;
        case 'N':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > MAX_PROMPTS) return pd_cmd_usage_error("bench-spec", "--random-prompts must be 1..%d", MAX_PROMPTS);
            o.random_n = (int)v;
            break;
        case 't':
            if (!pd_cmd_parse_int(optarg, &v) || v < 2 || v > 65536) return pd_cmd_usage_error("bench-spec", "--max-tokens must be 2..65536");
            o.max_tokens = (int)v;
            break;
        case 'L':
            if (!pd_cmd_parse_int(optarg, &v) || v < 16) return pd_cmd_usage_error("bench-spec", "--max-model-len must be >= 16");
            o.max_model_len = (int)v;
            break;
        case 'p':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > MAX_REPS) return pd_cmd_usage_error("bench-spec", "--reps must be 1..%d", MAX_REPS);
            o.reps = (int)v;
            break;
        case 'b': {
            o.n_batches = 0;
            char *dup = pd_strdup(optarg), *save = NULL;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (!pd_cmd_parse_int(t, &v) || v < 1 || v > MAX_BATCH || o.n_batches >= 16) {
                    pd_free(dup);
                    return pd_cmd_usage_error("bench-spec", "--batches: up to 16 sizes, each 1..%d", MAX_BATCH);
                }
                o.batches[o.n_batches++] = (int)v;
            }
            pd_free(dup);
            break;
        }
        case 'M': o.modes = optarg; break;
        case 'j': o.json_path = optarg; break;
        case 'S': o.sequential = true; break;
        case 'Q':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 64) return pd_cmd_usage_error("bench-spec", "--serial must be 1..64");
            o.serial = (int)v;
            break;
        case 'Y':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 4096) return pd_cmd_usage_error("bench-spec", "--dummy-num-layers must be 1..4096");
            o.dummy_layers = (int)v;
            break;
        case 'K':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 4096) return pd_cmd_usage_error("bench-spec", "--speculative-dummy-layers must be 1..4096");
            o.draft_layers = (int)v;
            break;
        case 'E': {
            char *colon = strchr(optarg, ':'), *end = NULL;
            if (!colon) return pd_cmd_usage_error("bench-spec", "--dummy-residual-scale is FROM_LAYER:EPS (e.g. 1:0.05)");
            *colon = 0;
            bool ok = pd_cmd_parse_int(optarg, &v) && v >= 0 && v <= 4096;
            *colon = ':';
            double eps = strtod(colon + 1, &end);
            if (!ok || end == colon + 1 || *end || !(eps >= 0.0 && eps <= 1.0))
                return pd_cmd_usage_error("bench-spec", "--dummy-residual-scale is FROM_LAYER:EPS, FROM_LAYER >= 0, 0 <= EPS <= 1 (got '%s')", optarg);
            o.scale_from = v == 0 ? PD_DUMMY_SCALE_ALL : (int)v;
            o.scale_eps = (float)eps;
            break;
        }
        case 'C': {
            char *end = NULL;
            double f = strtod(optarg, &end);
            if (end == optarg || *end || !(f >= 0.0 && f <= 1.0))
                return pd_cmd_usage_error("bench-spec", "--copy-chain is a fidelity in [0, 1] (got '%s')", optarg);
            o.copy_fidelity = f;
            break;
        }
        case 'h':
            printf("usage: pdserve bench-spec --model DIR [--load-format dummy|auto] [--device cpu|cuda]\n"
                   "         [--speculative-method draft|ngram|lookahead] [--speculative-model DIR] [--num-speculative-tokens K]\n"
                   "         (--golden FILE [--golden-key prompts|speculative_acceptance] | --random-prompt L [--random-prompts N])\n"
                   "         [--repeat N] [--max-tokens N] [--batches 1,8,32,64] [--modes off,adaptive,fixed] [--max-model-len N]\n"
                   "         [--reps N] [--sequential] [--serial S] [--json FILE]\n"
                   "         [--dummy-residual-scale FROM:EPS] [--dummy-num-layers K] [--speculative-dummy-layers K]\n"
                   "  --modes: off, adaptive, fixed (the --speculative-method), or METHOD:adaptive / METHOD:fixed; repeats\n"
                   "           allowed; the first is off. Engines live side by side and run interleaved (rotated order each\n"
                   "           rep, same warm-up); --sequential builds, runs and frees them one at a time instead.\n"
                   "           paused: the speculative engine before it timed again with speculation paused (plain steps in\n"
                   "           the same engine: its ratio active / paused is the policy's cost without the spread between\n"
                   "           engines; interleaved only)\n"
                   "  --serial S: a timed run is S batches one after another on the next prompts (batch 1: S prompts\n"
                   "           decoded alone in turn, so acceptance and speed are over S requests, not one)\n"
                   "  Benchmark fixture, --load-format dummy only (docs/benchmarks.md, 'controlled acceptance'):\n"
                   "  --dummy-residual-scale FROM:EPS  the target's layers FROM.. write into the residual stream scaled\n"
                   "           by EPS (their o_proj and down_proj scaled at load; every weight is still read)\n"
                   "  --speculative-dummy-layers K  the draft (--speculative-model, usually the target's folder) is cut\n"
                   "           to its first K layers with the target's seed: the same embeddings, layers, norm, lm_head\n"
                   "  --dummy-num-layers K  the target itself cut to its first K layers (same seeding)\n"
                   "  --copy-chain P  a copy workload for draft-free methods (with --random-prompt and, for a target\n"
                   "           whose next token depends on the last one alone, --dummy-residual-scale 0:0): the first\n"
                   "           plain engine decodes each prompt; the prompt becomes prompt + that output with each token\n"
                   "           kept with probability P (else a random token) + the prompt's last token again, so the\n"
                   "           output repeats the copy and prompt lookup proposes it: acceptance ~P, measured\n");
            return 0;
        default: return pd_cmd_usage_error("bench-spec", "unknown option (see --help)");
        }
    }
    if (optind < argc) return pd_cmd_usage_error("bench-spec", "unexpected argument '%s'", argv[optind]);
    if (!o.model) return pd_cmd_usage_error("bench-spec", "--model DIR is required");
    if ((o.dummy_layers || o.draft_layers || o.scale_from) && !o.dummy)
        return pd_cmd_usage_error("bench-spec", "--dummy-residual-scale, --dummy-num-layers and --speculative-dummy-layers need --load-format dummy");
    if (o.draft_layers && !o.draft)
        return pd_cmd_usage_error("bench-spec", "--speculative-dummy-layers needs --speculative-model DIR (the target's folder)");
    if (!o.golden == !o.random_len) return pd_cmd_usage_error("bench-spec", "give one of --golden FILE and --random-prompt L");
    if (o.random_n > 1 && !o.random_len) return pd_cmd_usage_error("bench-spec", "--random-prompts needs --random-prompt L");
    if (o.copy_fidelity >= 0 && (!o.random_len || o.sequential))
        return pd_cmd_usage_error("bench-spec", "--copy-chain needs --random-prompt L (and the interleaved protocol)");
    // Modes in the order given, repeats allowed (several plain engines give the noise band); the
    // first must be off: the baseline outputs are compared with.
    eng G[MAX_ENGINES];
    memset(G, 0, sizeof G);
    int n_eng = 0;
    {
        char *dup = pd_strdup(o.modes), *save = NULL;
        const char *bad = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (n_eng >= MAX_ENGINES) {
                bad = "more than 8 modes";
                break;
            }
            eng *g = &G[n_eng];
            char *colon = strchr(t, ':');
            int method = o.method;
            if (colon) {
                *colon = 0;
                pd_spec_method m;
                if (pd_spec_method_parse(t, &m) || m == PD_SPEC_NONE) {
                    bad = t;
                    break;
                }
                method = (int)m;
                t = colon + 1;
            }
            g->twin = -1;
            if (!strcmp(t, "paused") && !colon) {
                // The nearest speculative engine before it, timed with speculation paused.
                for (int j = n_eng - 1; j >= 0 && g->twin < 0; j--)
                    if (G[j].method != PD_SPEC_NONE && G[j].twin < 0) g->twin = j;
                for (int j = 0; j < n_eng && g->twin >= 0; j++)
                    if (G[j].twin == g->twin) g->twin = -1;  // one paused twin per engine
                if (g->twin < 0) {
                    pd_free(dup);
                    return pd_cmd_usage_error("bench-spec", "--modes: 'paused' follows a speculative engine (one paused entry each)");
                }
                g->method = G[g->twin].method, g->fixed = G[g->twin].fixed;
            } else if (!strcmp(t, "off") && !colon) g->method = PD_SPEC_NONE;
            else if (!strcmp(t, "adaptive") || !strcmp(t, "fixed")) g->method = method, g->fixed = !strcmp(t, "fixed");
            else {
                bad = t;
                break;
            }
            if (g->method == PD_SPEC_NONE && strcmp(t, "off") && g->twin < 0) {
                int rc = pd_cmd_usage_error("bench-spec", "--modes: '%s' needs --speculative-method or METHOD:%s", t, t);
                pd_free(dup); /* t points into dup */
                return rc;
            }
            if (g->method == PD_SPEC_DRAFT && !o.draft) {
                pd_free(dup);
                return pd_cmd_usage_error("bench-spec", "draft needs --speculative-model DIR");
            }
            for (int b = 0; b < 16; b++) g->n_same[b] = -1;
            n_eng++;
        }
        int rc = 0;
        if (bad) rc = pd_cmd_usage_error("bench-spec", "--modes: off, adaptive, fixed, METHOD:adaptive|fixed or paused (8 at most), not '%s'", bad);
        pd_free(dup); /* bad points into dup */
        if (bad) return rc;
    }
    if (o.method == PD_SPEC_DRAFT && !o.draft) return pd_cmd_usage_error("bench-spec", "draft needs --speculative-model DIR");
    if (n_eng == 0 || G[0].method != PD_SPEC_NONE) return pd_cmd_usage_error("bench-spec", "--modes must start with off (the baseline)");
    bool any_paused = false;
    for (int j = 0; j < n_eng; j++) any_paused |= G[j].twin >= 0;
    if (any_paused && o.sequential) return pd_cmd_usage_error("bench-spec", "--modes paused needs the interleaved protocol (not --sequential)");
    bool any_spec = false;
    for (int j = 0; j < n_eng; j++) any_spec |= G[j].method != PD_SPEC_NONE;
    if (!any_spec && !o.method) return pd_cmd_usage_error("bench-spec", "--speculative-method is required");
    prompts P = {0};
    if (o.golden) {
        if (!load_golden(&P, o.golden, o.golden_key)) return 1;
    } else {
        pd_rng r;
        pd_rng_seed(&r, 17);
        for (int k = 0; k < o.random_n; k++) {
            P.len[k] = o.random_len;
            P.ids[k] = pd_malloc(sizeof(int32_t) * (size_t)o.random_len);
            for (int i = 0; i < o.random_len; i++) P.ids[k][i] = 1 + (int32_t)(pd_rng_next(&r) % 4000);
            P.n++;
        }
    }
    repeat_prompts(&P, o.repeat);
    int max_len = 0;
    for (int i = 0; i < P.n; i++) max_len = PD_MAX(max_len, P.len[i]);
    int copy_len = o.copy_fidelity >= 0 ? o.max_tokens + 8 : 0;  // the copy: each prompt grows by copy_len + 1
    max_len += copy_len ? copy_len + 1 : 0;
    if (max_len + o.max_tokens + 32 > o.max_model_len) o.max_model_len = max_len + o.max_tokens + 32;
    o.kv_len = max_len + o.max_tokens;
    int bmax = 1;
    for (int i = 0; i < o.n_batches; i++) bmax = PD_MAX(bmax, o.batches[i]);
    printf("bench-spec: %s, %s, k=%d, %d prompt(s) of up to %d tokens, %d new tokens per request, %d engines %s, %d reps\n",
           o.model, o.method ? pd_spec_method_name((pd_spec_method)o.method) : "(per mode)", o.k, P.n, max_len, o.max_tokens,
           n_eng, o.sequential ? "one at a time" : "interleaved", o.reps);
    json_t *out = json_object(), *arr = json_array(), *sums = json_array(), *wl = json_array();
    json_object_set_new(out, "model", json_string(o.model));
    json_object_set_new(out, "method", json_string(pd_spec_method_name((pd_spec_method)o.method)));
    json_object_set_new(out, "k", json_integer(o.k));
    json_object_set_new(out, "reps", json_integer(o.reps));
    json_object_set_new(out, "interleaved", json_boolean(!o.sequential));
    json_object_set_new(out, "results", arr);
    json_object_set_new(out, "summary", sums);
    json_object_set_new(out, "workload", wl);
    int32_t *base_out[16] = {0};
    int32_t *scratch = pd_malloc(sizeof(int32_t) * (size_t)bmax * (size_t)o.serial * (size_t)o.max_tokens);
    int rc = scratch ? 0 : 1;
    // Interleaved: every engine built first (each warmed the same way: its warm-up graphs, one short
    // batch-1 run), then batch by batch the rotated rounds. Sequential: one engine at a time.
    int n_groups = o.sequential ? n_eng : 1;
    for (int gi = 0; gi < n_groups && !rc; gi++) {
        eng *grp = o.sequential ? &G[gi] : G;
        int n = o.sequential ? 1 : n_eng;
        for (int j = 0; j < n && !rc; j++) {
            if (grp[j].twin >= 0) {  // (the interleaved protocol only: its twin was built before it)
                grp[j].e = G[grp[j].twin].e;
                continue;
            }
            grp[j].e = make_engine(&o, grp[j].method, grp[j].fixed);
            if (!grp[j].e) {
                rc = 1;
                break;
            }
            result warm = {.out = scratch};
            (void)run_batch(grp[j].e, &P, 1, 0, PD_MIN(o.max_tokens, 16), &warm);  // first steps: cuBLASLt plans, allocations
        }
        if (copy_len && !rc && !make_copy_prompts(&o, &P, G[0].e, copy_len, wl)) rc = 1;
        for (int bi = 0; bi < o.n_batches && !rc; bi++)
            if (!run_group(&o, &P, grp, n, bi, &G[0], scratch, &base_out[bi])) rc = 1;
        for (int j = 0; j < n; j++) {
            if (grp[j].e && grp[j].twin < 0) pd_engine_free(grp[j].e);
            grp[j].e = NULL;
        }
    }
    for (int bi = 0; bi < o.n_batches && !rc; bi++) {
        report_batch(&o, G, n_eng, bi, arr, sums);
        if (base_out[bi]) {
            json_t *w = json_pack("{s:i}", "batch", o.batches[bi]);
            describe_outputs(base_out[bi], o.batches[bi] * o.serial, o.max_tokens, w);
            json_array_append_new(wl, w);
        }
    }
    for (int bi = 0; bi < 16; bi++) pd_free(base_out[bi]);
    pd_free(scratch);
    for (int i = 0; i < P.n; i++) pd_free(P.ids[i]);
    if (!rc && o.json_path && json_dump_file(out, o.json_path, JSON_INDENT(1))) {
        fprintf(stderr, "bench-spec: cannot write %s\n", o.json_path);
        rc = 1;
    }
    json_decref(out);
    return rc;
}
