// mask_cost.c — the per-step cost of structured-output token masks at a given batch size, on a
// real tokenizer's vocabulary (bench/mask_cost.sh builds it and, by default, Llama 3's 128k one).
//
//   mask_cost TOKENIZER_DIR [--batch 64] [--steps 300] [--warmup 300] [--seed 1] [--step-ms 7.84]
//
// BATCH sequences decode at once, each under a json_schema grammar (four OpenAI-style schemas,
// compiled once each as the server's grammar cache does; sequence i uses schema i % 4). Every
// step, for every sequence, as the engine does on its thread: pd_grammar_matcher_fill_mask (the
// mask build), then the mask is applied to a row of VOCAB random logits the way the CPU sampler
// does (disallowed -> -inf), the best allowed token is taken and accepted (an end token, when
// allowed, half of the time). A sequence that ends, or passes 200 tokens, starts over with a fresh
// matcher, so the batch stays full and walks through every part of its schema. Timing is thread
// CPU time. The grammars' caches (per grammar position, and per stack for the tokens that leave a
// rule) are filled lazily and kept with the compiled grammar, which the server caches by schema:
// the first --warmup steps are what a new schema costs until its caches are warm (reported as a
// total and as its worst step); then mean / p50 / p99 / max over --steps steps of the whole
// batch's mask build and mask application, and the share of a step of --step-ms milliseconds (7.84: the batch-64 Llama-3-8B-shape step on the H100,
// docs/benchmarks.md).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grammar/grammar.h"
#include "tok/tok.h"

static const char *k_schemas[] = {
    // a zod-like response model
    "{\"type\":\"object\",\"additionalProperties\":false,\"required\":[\"name\",\"age\",\"email\",\"tags\"],"
    "\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},"
    "\"maxItems\":5}}}",
    // enums, booleans, numbers, nullable, nested object
    "{\"type\":\"object\",\"additionalProperties\":false,\"required\":[\"city\",\"unit\",\"temperature\",\"raining\","
    "\"wind\"],\"properties\":{\"city\":{\"type\":\"string\"},\"unit\":{\"enum\":[\"celsius\",\"fahrenheit\"]},"
    "\"temperature\":{\"type\":\"number\"},\"raining\":{\"type\":\"boolean\"},\"wind\":{\"type\":\"object\","
    "\"additionalProperties\":false,\"required\":[\"speed\",\"direction\"],\"properties\":{\"speed\":{\"type\":"
    "[\"number\",\"null\"]},\"direction\":{\"enum\":[\"N\",\"E\",\"S\",\"W\"]}}}}}",
    // an array of objects with anyOf (a tool-call-like list)
    "{\"type\":\"object\",\"additionalProperties\":false,\"required\":[\"steps\"],\"properties\":{\"steps\":{\"type\":"
    "\"array\",\"maxItems\":4,\"items\":{\"anyOf\":[{\"type\":\"object\",\"additionalProperties\":false,\"required\":"
    "[\"tool\",\"query\"],\"properties\":{\"tool\":{\"const\":\"search\"},\"query\":{\"type\":\"string\"}}},{\"type\":"
    "\"object\",\"additionalProperties\":false,\"required\":[\"tool\",\"expr\"],\"properties\":{\"tool\":{\"const\":"
    "\"calc\"},\"expr\":{\"type\":\"string\",\"maxLength\":40}}}]}}}}",
    // dates, uuids, optional fields, a recursive tree
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"additionalProperties\":false,\"required\":[\"id\",\"when\"],"
    "\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"when\":{\"type\":\"string\",\"format\":"
    "\"date-time\"},\"note\":{\"type\":\"string\"},\"kids\":{\"type\":\"array\",\"maxItems\":2,\"items\":{\"$ref\":"
    "\"#/$defs/node\"}}}}},\"$ref\":\"#/$defs/node\"}",
};
#define N_SCHEMAS ((int)(sizeof k_schemas / sizeof k_schemas[0]))

static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static uint64_t rng_next(uint64_t *s) {  // splitmix64
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: mask_cost TOKENIZER_DIR [--batch N] [--steps N] [--seed N] [--step-ms MS]\n");
        return 2;
    }
    int batch = 64, steps = 300, warmup = 300;
    uint64_t seed = 1;
    double step_ms = 7.84;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--batch")) batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup")) warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--step-ms")) step_ms = atof(argv[i + 1]);
        else {
            fprintf(stderr, "mask_cost: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (batch < 1 || steps < 2 || warmup < 0) {
        fprintf(stderr, "mask_cost: --batch >= 1, --steps >= 2, --warmup >= 0\n");
        return 2;
    }
    pd_err err = {0};
    double t0 = cpu_ms();
    pd_tok *tok = pd_tok_load(argv[1], &err);
    if (!tok) {
        fprintf(stderr, "mask_cost: %s\n", err.msg);
        return 1;
    }
    double t_tok = cpu_ms() - t0;
    t0 = cpu_ms();
    pd_grammar_vocab *v = pd_grammar_vocab_new(tok, &err);
    if (!v) {
        fprintf(stderr, "mask_cost: vocabulary: %s\n", err.msg);
        return 1;
    }
    double t_vocab = cpu_ms() - t0;
    int V = pd_tok_n_vocab(tok), words = pd_grammar_mask_words(v);
    int32_t eos = pd_tok_eos_id(tok);
    pd_grammar *g[N_SCHEMAS];
    double t_compile = 0;
    for (int s = 0; s < N_SCHEMAS; s++) {
        json_t *j = json_loads(k_schemas[s], 0, NULL);
        char *gbnf = NULL;
        if (!j || pd_grammar_schema_to_gbnf(j, &gbnf, &err) != PD_OK) {
            fprintf(stderr, "mask_cost: schema %d: %s\n", s, err.msg);
            return 1;
        }
        t0 = cpu_ms();
        g[s] = pd_grammar_new(gbnf, strlen(gbnf), v, &err);
        t_compile += cpu_ms() - t0;
        if (!g[s]) {
            fprintf(stderr, "mask_cost: schema %d: %s\n", s, err.msg);
            return 1;
        }
        pd_free(gbnf);
        json_decref(j);
    }
    printf("vocabulary: %d tokens (%d mask words = %zu bytes a row), end token %d; tokenizer load %.0f ms, "
           "vocabulary trie %.0f ms, %d schemas compiled in %.1f ms (CPU)\n",
           V, words, (size_t)words * 4, eos, t_tok, t_vocab, N_SCHEMAS, t_compile);

    pd_grammar_matcher **m = calloc((size_t)batch, sizeof *m);
    int *len = calloc((size_t)batch, sizeof *len);
    uint32_t *mask = malloc(sizeof(uint32_t) * (size_t)words * (size_t)batch);
    float *logits = malloc(sizeof(float) * (size_t)V);
    int total = warmup + steps;
    double *fill = malloc(sizeof(double) * (size_t)total), *apply = malloc(sizeof(double) * (size_t)total);
    if (!m || !len || !mask || !logits || !fill || !apply) return 1;
    for (int i = 0; i < batch; i++) m[i] = pd_grammar_matcher_new(g[i % N_SCHEMAS], &eos, 1);
    uint64_t rng = seed;
    long n_tokens = 0, n_done = 0, n_allowed = 0;
    for (int step = 0; step < total; step++) {
        double f = 0, a = 0;
        for (int i = 0; i < batch; i++) {
            uint32_t *row = mask + (size_t)i * (size_t)words;
            t0 = cpu_ms();
            int n = pd_grammar_matcher_fill_mask(m[i], row);
            f += cpu_ms() - t0;
            n_allowed += n;
            for (int t = 0; t < V; t++) logits[t] = (float)(rng_next(&rng) >> 40) * 0x1p-24f;  // untimed
            t0 = cpu_ms();
            for (int t = 0; t < V; t++)  // what the CPU sampler's apply_mask does
                if (!((row[t >> 5] >> (t & 31)) & 1)) logits[t] = -INFINITY;
            a += cpu_ms() - t0;
            int best = -1;
            bool eos_ok = (row[eos >> 5] >> (eos & 31)) & 1;
            if (eos_ok && (rng_next(&rng) & 1)) best = eos;
            for (int t = 0; best != eos && t < V; t++)
                if (t != eos && logits[t] > -INFINITY && (best < 0 || logits[t] > logits[best])) best = t;
            if (best < 0) best = eos;  // only the end token is allowed
            if (best == eos || ++len[i] >= 200 || pd_grammar_matcher_accept(m[i], best) != PD_OK ||
                pd_grammar_matcher_is_done(m[i])) {
                n_done += best == eos || pd_grammar_matcher_is_done(m[i]);
                pd_grammar_matcher_free(m[i]);
                m[i] = pd_grammar_matcher_new(g[i % N_SCHEMAS], &eos, 1);
                len[i] = 0;
            }
            n_tokens++;
        }
        fill[step] = f;
        apply[step] = a;
    }
    printf("batch %d, %d + %d steps (%ld tokens, %ld documents completed, %.0f tokens allowed per mask on average)\n",
           batch, warmup, steps, n_tokens, n_done, (double)n_allowed / (double)n_tokens);
    double wsum = 0, wmax = 0;
    for (int i = 0; i < warmup; i++) wsum += fill[i], wmax = fill[i] > wmax ? fill[i] : wmax;
    printf("warm-up, steps 1..%d (new schemas, caches filling): mask build %.1f ms in all, worst step %.1f ms\n", warmup,
           wsum, wmax);
    double *F = fill + warmup, *A = apply + warmup;  // the measured steps
    int n = steps;
    double *tot = malloc(sizeof(double) * (size_t)n);
    double sf = 0, sa = 0;
    for (int i = 0; i < n; i++) {
        tot[i] = F[i] + A[i];
        sf += F[i];
        sa += A[i];
    }
    qsort(F, (size_t)n, sizeof(double), cmp_d);
    qsort(A, (size_t)n, sizeof(double), cmp_d);
    qsort(tot, (size_t)n, sizeof(double), cmp_d);
#define P(a, q) (a)[(int)((double)(n - 1) * (q))]
    printf("per step, steps %d..%d (CPU ms for the whole batch):\n", warmup + 1, total);
    printf("  mask build  mean %.3f  p50 %.3f  p99 %.3f  max %.3f  (%.1f us per sequence)\n", sf / n, P(F, .5),
           P(F, .99), F[n - 1], 1e3 * sf / n / batch);
    printf("  mask apply  mean %.3f  p50 %.3f  p99 %.3f  max %.3f\n", sa / n, P(A, .5), P(A, .99), A[n - 1]);
    printf("  total       mean %.3f  p50 %.3f  p99 %.3f  max %.3f\n", (sf + sa) / n, P(tot, .5), P(tot, .99),
           tot[n - 1]);
    printf("share of a %.2f ms step: mean %.1f%%, p50 %.1f%%, p99 %.1f%% (build alone: mean %.1f%%, p99 %.1f%%)\n",
           step_ms, 100 * (sf + sa) / n / step_ms, 100 * P(tot, .5) / step_ms, 100 * P(tot, .99) / step_ms,
           100 * sf / n / step_ms, 100 * P(F, .99) / step_ms);
    for (int i = 0; i < batch; i++) pd_grammar_matcher_free(m[i]);
    for (int s = 0; s < N_SCHEMAS; s++) pd_grammar_unref(g[s]);
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
    free(m), free(len), free(mask), free(logits), free(fill), free(apply), free(tot);
    return 0;
}
