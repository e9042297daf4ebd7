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
static bool run_batch(pd_engine *e, const prompts *P, int B, int max_tokens, result *res) {
    pd_engine_stats s0, s1;
    pd_engine_stats_get(e, &s0);
    int64_t first_max = 0, last = 0, t0 = pd_time_us(), toks_after = 0;  // tokens after the last first token
    int n_out[MAX_BATCH] = {0}, done = 0;
    bool got_first[MAX_BATCH] = {0};
    pd_err err = {0};
    for (int i = 0; i < B; i++) {
        pd_engine_request q = {.id = (uint64_t)i + 1000, .prompt = P->ids[i % P->n], .n_prompt = P->len[i % P->n],
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
    return true;
}

typedef struct opts {
    const char *model, *draft, *golden, *golden_key, *device, *json_path;
    bool dummy;
    int method, k, repeat, random_len, max_tokens, max_model_len, reps;
    int batches[16], n_batches;
    const char *modes;  // "off,adaptive,fixed"
} opts;

static pd_engine *make_engine(const opts *o, int spec_method, bool fixed) {
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = o->model;
    p.device = o->device;
    p.dummy_weights = o->dummy;
    p.max_model_len = o->max_model_len;
    int bmax = 1;
    for (int i = 0; i < o->n_batches; i++) bmax = PD_MAX(bmax, o->batches[i]);
    p.max_num_seqs = bmax;
    p.spec_method = spec_method;
    p.spec_model_dir = spec_method == PD_SPEC_DRAFT ? o->draft : NULL;
    p.spec_k = o->k;
    p.spec_fixed = fixed;
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

int pd_cmd_bench_spec(int argc, char **argv) {
    static const struct option lo[] = {{"model", required_argument, 0, 'm'},       {"load-format", required_argument, 0, 'l'},
                                       {"device", required_argument, 0, 'd'},      {"speculative-method", required_argument, 0, 's'},
                                       {"speculative-model", required_argument, 0, 'D'}, {"num-speculative-tokens", required_argument, 0, 'k'},
                                       {"golden", required_argument, 0, 'g'},      {"golden-key", required_argument, 0, 'G'},
                                       {"repeat", required_argument, 0, 'r'},      {"random-prompt", required_argument, 0, 'R'},
                                       {"max-tokens", required_argument, 0, 't'},  {"batches", required_argument, 0, 'b'},
                                       {"modes", required_argument, 0, 'M'},       {"max-model-len", required_argument, 0, 'L'},
                                       {"reps", required_argument, 0, 'p'},        {"json", required_argument, 0, 'j'},
                                       {"help", no_argument, 0, 'h'},              {0, 0, 0, 0}};
    opts o = {.device = "auto", .golden_key = "prompts", .k = 4, .repeat = 1, .max_tokens = 128, .max_model_len = 1024,
              .reps = 1, .modes = "off,adaptive,fixed", .batches = {1, 8, 32, 64}, .n_batches = 4};
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
        case 't':
            if (!pd_cmd_parse_int(optarg, &v) || v < 2 || v > 65536) return pd_cmd_usage_error("bench-spec", "--max-tokens must be 2..65536");
            o.max_tokens = (int)v;
            break;
        case 'L':
            if (!pd_cmd_parse_int(optarg, &v) || v < 16) return pd_cmd_usage_error("bench-spec", "--max-model-len must be >= 16");
            o.max_model_len = (int)v;
            break;
        case 'p':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 20) return pd_cmd_usage_error("bench-spec", "--reps must be 1..20");
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
        case 'h':
            printf("usage: pdserve bench-spec --model DIR [--load-format dummy|auto] [--device cpu|cuda]\n"
                   "         --speculative-method draft|ngram|lookahead [--speculative-model DIR] [--num-speculative-tokens K]\n"
                   "         (--golden FILE [--golden-key prompts|speculative_acceptance] | --random-prompt L) [--repeat N]\n"
                   "         [--max-tokens N] [--batches 1,8,32,64] [--modes off,adaptive,fixed] [--max-model-len N]\n"
                   "         [--reps N] [--json FILE]\n");
            return 0;
        default: return pd_cmd_usage_error("bench-spec", "unknown option (see --help)");
        }
    }
    if (optind < argc) return pd_cmd_usage_error("bench-spec", "unexpected argument '%s'", argv[optind]);
    if (!o.model) return pd_cmd_usage_error("bench-spec", "--model DIR is required");
    if (!o.method) return pd_cmd_usage_error("bench-spec", "--speculative-method is required");
    if (o.method == PD_SPEC_DRAFT && !o.draft) return pd_cmd_usage_error("bench-spec", "draft needs --speculative-model DIR");
    if (!o.golden == !o.random_len) return pd_cmd_usage_error("bench-spec", "give one of --golden FILE and --random-prompt L");
    // Modes in the order given, repeats allowed (a second "off" shows the drift between engines);
    // the first must be off: the baseline of the speedups.
    int modes[16], n_modes = 0;
    {
        char *dup = pd_strdup(o.modes), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t && n_modes < 16; t = strtok_r(NULL, ",", &save)) {
            int m = !strcmp(t, "off") ? 0 : !strcmp(t, "adaptive") ? 1 : !strcmp(t, "fixed") ? 2 : -1;
            if (m < 0) {
                pd_free(dup);
                return pd_cmd_usage_error("bench-spec", "--modes: off, adaptive or fixed, not '%s'", t);
            }
            modes[n_modes++] = m;
        }
        pd_free(dup);
    }
    if (n_modes == 0 || modes[0] != 0) return pd_cmd_usage_error("bench-spec", "--modes must start with off (the baseline)");
    prompts P = {0};
    if (o.golden) {
        if (!load_golden(&P, o.golden, o.golden_key)) return 1;
    } else {
        pd_rng r;
        pd_rng_seed(&r, 17);
        P.n = 1;
        P.len[0] = o.random_len;
        P.ids[0] = pd_malloc(sizeof(int32_t) * (size_t)o.random_len);
        for (int i = 0; i < o.random_len; i++) P.ids[0][i] = 1 + (int32_t)(pd_rng_next(&r) % 4000);
    }
    repeat_prompts(&P, o.repeat);
    int max_len = 0;
    for (int i = 0; i < P.n; i++) max_len = PD_MAX(max_len, P.len[i]);
    if (max_len + o.max_tokens + 32 > o.max_model_len) o.max_model_len = max_len + o.max_tokens + 32;
    printf("bench-spec: %s, %s, k=%d, %d prompt(s) of up to %d tokens, %d new tokens per request\n", o.model,
           pd_spec_method_name((pd_spec_method)o.method), o.k, P.n, max_len, o.max_tokens);
    json_t *out = json_object(), *arr = json_array();
    json_object_set_new(out, "model", json_string(o.model));
    json_object_set_new(out, "method", json_string(pd_spec_method_name((pd_spec_method)o.method)));
    json_object_set_new(out, "k", json_integer(o.k));
    json_object_set_new(out, "results", arr);
    double base[16] = {0};
    int32_t *base_out[16] = {0};
    int rc = 0;
    for (int mi = 0; mi < n_modes && !rc; mi++) {
        int mode = modes[mi];
        bool first = mi == 0;
        pd_engine *e = make_engine(&o, mode == 0 ? 0 : o.method, mode == 2);
        if (!e) {
            rc = 1;
            break;
        }
        result warm = {.out = pd_malloc(sizeof(int32_t) * (size_t)o.max_tokens)};
        (void)run_batch(e, &P, 1, PD_MIN(o.max_tokens, 16), &warm);  // first steps: cuBLASLt plans, allocations
        pd_free(warm.out);
        for (int bi = 0; bi < o.n_batches && !rc; bi++) {
            int B = o.batches[bi];
            double best = 0;
            result res = {.out = pd_malloc(sizeof(int32_t) * (size_t)B * (size_t)o.max_tokens)}, keep = {0};
            for (int rep = 0; rep < o.reps; rep++) {
                if (!run_batch(e, &P, B, o.max_tokens, &res)) {
                    rc = 1;
                    break;
                }
                if (res.tok_s > best) best = res.tok_s, keep = res;
            }
            if (rc) {
                pd_free(res.out);
                break;
            }
            const char *mname = mode == 0 ? "off" : mode == 1 ? "adaptive" : "fixed";
            int n_same = -1;
            if (first) {
                base[bi] = best;
                base_out[bi] = res.out;
            } else if (base_out[bi]) {
                n_same = 0;
                for (int i = 0; i < B; i++)
                    n_same += !memcmp(res.out + (size_t)i * o.max_tokens, base_out[bi] + (size_t)i * o.max_tokens,
                                      sizeof(int32_t) * (size_t)o.max_tokens);
            }
            double acc = keep.drafted ? (double)keep.accepted / (double)keep.drafted : 0;
            double mal = keep.steps ? (double)keep.emitted / (double)keep.steps : 0;
            printf("%-10s %-8s batch=%-3d %9.1f tok/s  %5.2fx off  acceptance %.3f  tokens/verify %.2f  drafted %lld",
                   pd_spec_method_name((pd_spec_method)o.method), mname, B, best, base[bi] > 0 ? best / base[bi] : 0, acc, mal,
                   (long long)keep.drafted);
            if (n_same >= 0) printf("  same as off %d/%d", n_same, B);
            printf("\n");
            fflush(stdout);
            json_array_append_new(arr, json_pack("{s:s, s:i, s:f, s:f, s:f, s:f, s:I, s:I, s:I, s:i}", "mode", mname, "batch", B,
                                                 "tok_s", best, "speedup", base[bi] > 0 ? best / base[bi] : 0.0, "acceptance", acc,
                                                 "tokens_per_verify", mal, "drafted", (json_int_t)keep.drafted, "accepted",
                                                 (json_int_t)keep.accepted, "tokens", (json_int_t)keep.n_tokens, "same_as_off", n_same));
            if (!first) pd_free(res.out);
        }
        pd_engine_free(e);
    }
    for (int bi = 0; bi < 16; bi++) pd_free(base_out[bi]);
    for (int i = 0; i < P.n; i++) pd_free(P.ids[i]);
    if (o.json_path && json_dump_file(out, o.json_path, JSON_INDENT(1))) {
        fprintf(stderr, "bench-spec: cannot write %s\n", o.json_path);
        rc = 1;
    }
    json_decref(out);
    return rc;
}
