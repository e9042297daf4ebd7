// dataset.c — what the benchmark sends and when: prompts of exact token lengths built from token
// ids with a seeded RNG, their max_tokens, and the arrival schedule.
//
// Datasets:
//   random         n prompts of input_len ids and output_len tokens, each length drawn uniformly
//                  from [len*(1-range_ratio), len*(1+range_ratio)] (at least 1)
//   shared-prefix  n_prefixes random prefixes of prefix_len ids; each prompt is one of them
//                  (chosen by the RNG) + its own suffix_len random ids (the prefix-cache workload)
//   long-mix       each prompt is long_len ids with probability long_fraction, else short_len
//                  (a few long prompts among many short ones: the chunked-prefill workload)
//   trace          JSON Lines, one request a line: {"timestamp": s, "prompt_len": n | "prompt":
//                  "text", "output_len": n}; arrivals replay the timestamps (relative to the
//                  earliest); "input_len"/"output_length"/"max_tokens" are accepted aliases
// Ids come from [token_id_min, token_id_max): the default [100, 4000) exists in every
// Llama-family vocabulary and avoids the special tokens at either end of small ones.
//
// Arrivals: gaps are gamma(shape = burstiness, scale = 1 / (rate * burstiness)), so the mean gap is
// 1/rate whatever the burstiness, and burstiness 1 is a Poisson process (vLLM's definition).
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "bench/bench.h"

pd_bench_dataset_params pd_bench_dataset_params_default(void) {
    return (pd_bench_dataset_params){
        .kind = PD_BENCH_DATASET_RANDOM,
        .n_prompts = 100,
        .seed = 0,
        .token_id_min = 100,
        .token_id_max = 4000,
        .input_len = 1024,
        .output_len = 128,
        .range_ratio = 0.0,
        .prefix_len = 512,
        .n_prefixes = 4,
        .suffix_len = 128,
        .long_fraction = 0.2,
        .long_len = 8192,
        .short_len = 512,
    };
}

static const struct { const char *name; pd_bench_dataset_kind kind; } KINDS[] = {
    {"random", PD_BENCH_DATASET_RANDOM},
    {"shared-prefix", PD_BENCH_DATASET_SHARED_PREFIX},
    {"long-mix", PD_BENCH_DATASET_LONG_MIX},
    {"trace", PD_BENCH_DATASET_TRACE},
};

pd_bench_dataset_kind pd_bench_dataset_kind_parse(const char *s) {
    for (size_t i = 0; s && i < PD_ARRAY_LEN(KINDS); i++)
        if (!strcmp(s, KINDS[i].name)) return KINDS[i].kind;
    return 0;
}

const char *pd_bench_dataset_kind_name(pd_bench_dataset_kind k) {
    for (size_t i = 0; i < PD_ARRAY_LEN(KINDS); i++)
        if (KINDS[i].kind == k) return KINDS[i].name;
    return "unknown";
}

void pd_bench_dataset_free(pd_bench_dataset *d) {
    if (!d) return;
    for (int i = 0; i < d->n; i++) {
        pd_free(d->prompts[i].ids);
        pd_free(d->prompts[i].text);
    }
    pd_free(d->prompts);
    pd_free(d);
}

// ---- random numbers ----------------------------------------------------------------------------

double pd_bench_dataset_gamma(pd_rng *rng, double shape, double scale) {
    if (shape < 1) {  // boost: gamma(a) = gamma(a + 1) * U^(1/a)
        double u = pd_rng_uniform(rng);
        return pd_bench_dataset_gamma(rng, shape + 1, scale) * pow(u > 0 ? u : 1e-300, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = pd_rng_normal(rng), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = pd_rng_uniform(rng);
        if (u < 1.0 - 0.0331 * x * x * x * x) return d * v * scale;
        if (log(u > 0 ? u : 1e-300) < 0.5 * x * x + d * (1.0 - v + log(v))) return d * v * scale;
    }
}

void pd_bench_dataset_arrivals(int n, double rate, double burstiness, uint64_t seed, double *out) {
    if (n <= 0) return;
    if (!(rate > 0) || isinf(rate) || !(burstiness > 0)) {
        for (int i = 0; i < n; i++) out[i] = 0;
        return;
    }
    pd_rng rng;
    pd_rng_seed(&rng, seed ^ 0xa77e5ull);
    double theta = 1.0 / (rate * burstiness), t = 0;
    out[0] = 0;
    for (int i = 1; i < n; i++) {
        t += pd_bench_dataset_gamma(&rng, burstiness, theta);
        out[i] = t;
    }
}

// A length around len: uniform in [len*(1-r), len*(1+r)], at least 1.
static int draw_len(pd_rng *rng, int len, double r) {
    if (r <= 0) return len;
    int lo = (int)floor(len * (1.0 - r)), hi = (int)ceil(len * (1.0 + r));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int)(pd_rng_uniform(rng) * (hi - lo + 1));
}

static void fill_ids(pd_rng *rng, const pd_bench_dataset_params *p, int32_t *ids, int n) {
    int span = p->token_id_max - p->token_id_min;
    for (int i = 0; i < n; i++) ids[i] = p->token_id_min + (int32_t)(pd_rng_next(rng) % (uint64_t)span);
}

// ---- generated datasets --------------------------------------------------------------------------

static pd_status check_params(const pd_bench_dataset_params *p, pd_err *err) {
    if (p->token_id_min < 0 || p->token_id_max <= p->token_id_min)
        return pd_err_set(err, PD_ERR_INVALID, "token id range [%d, %d) is empty", p->token_id_min, p->token_id_max);
    if (p->kind != PD_BENCH_DATASET_TRACE && p->n_prompts < 1)
        return pd_err_set(err, PD_ERR_INVALID, "--num-prompts must be at least 1");
    if (p->output_len < 1) return pd_err_set(err, PD_ERR_INVALID, "--output-len must be at least 1");
    if (p->range_ratio < 0 || p->range_ratio >= 1)
        return pd_err_set(err, PD_ERR_INVALID, "--range-ratio must be in [0, 1)");
    switch (p->kind) {
    case PD_BENCH_DATASET_RANDOM:
        if (p->input_len < 1) return pd_err_set(err, PD_ERR_INVALID, "--input-len must be at least 1");
        break;
    case PD_BENCH_DATASET_SHARED_PREFIX:
        if (p->prefix_len < 0 || p->suffix_len < 0 || p->prefix_len + p->suffix_len < 1 || p->n_prefixes < 1)
            return pd_err_set(err, PD_ERR_INVALID, "shared-prefix needs --prefix-len + --suffix-len >= 1 and --num-prefixes >= 1");
        break;
    case PD_BENCH_DATASET_LONG_MIX:
        if (p->long_len < 1 || p->short_len < 1 || p->long_fraction < 0 || p->long_fraction > 1)
            return pd_err_set(err, PD_ERR_INVALID, "long-mix needs --long-len, --short-len >= 1 and --long-fraction in [0, 1]");
        break;
    case PD_BENCH_DATASET_TRACE:
        if (!p->trace_path) return pd_err_set(err, PD_ERR_INVALID, "--dataset trace needs --trace FILE");
        break;
    default:
        return pd_err_set(err, PD_ERR_INVALID, "unknown dataset kind");
    }
    return PD_OK;
}

static pd_status generate(pd_bench_dataset *d, const pd_bench_dataset_params *p) {
    pd_rng rng;
    pd_rng_seed(&rng, p->seed);
    int32_t *prefixes = NULL;
    if (p->kind == PD_BENCH_DATASET_SHARED_PREFIX && p->prefix_len > 0) {
        size_t n = (size_t)p->n_prefixes * (size_t)p->prefix_len;
        if (!(prefixes = pd_malloc(n * sizeof *prefixes))) return PD_ERR_NOMEM;
        fill_ids(&rng, p, prefixes, (int)n);
    }
    pd_status st = PD_OK;
    for (int i = 0; i < p->n_prompts; i++) {
        pd_bench_prompt *q = &d->prompts[i];
        int n_in = 0, prefix_idx = -1;
        switch (p->kind) {
        case PD_BENCH_DATASET_RANDOM: n_in = draw_len(&rng, p->input_len, p->range_ratio); break;
        case PD_BENCH_DATASET_SHARED_PREFIX:
            prefix_idx = (int)(pd_rng_next(&rng) % (uint64_t)p->n_prefixes);
            n_in = p->prefix_len + p->suffix_len;
            break;
        case PD_BENCH_DATASET_LONG_MIX:
            n_in = pd_rng_uniform(&rng) < p->long_fraction ? p->long_len : p->short_len;
            break;
        default: break;
        }
        q->n_output = draw_len(&rng, p->output_len, p->range_ratio);
        if (!(q->ids = pd_malloc((size_t)n_in * sizeof *q->ids))) {
            st = PD_ERR_NOMEM;
            break;
        }
        q->n_ids = n_in;
        int off = 0;
        if (prefix_idx >= 0 && p->prefix_len > 0) {
            memcpy(q->ids, prefixes + (size_t)prefix_idx * (size_t)p->prefix_len, (size_t)p->prefix_len * sizeof *q->ids);
            off = p->prefix_len;
        }
        fill_ids(&rng, p, q->ids + off, n_in - off);
        d->n = i + 1;
    }
    pd_free(prefixes);
    return st;
}

// ---- traces ------------------------------------------------------------------------------------

// The first integer field among names, or -1 when none is present; -2 when one has a bad value.
static long json_int_field(json_t *o, const char *const *names) {
    for (; *names; names++) {
        json_t *v = json_object_get(o, *names);
        if (!v) continue;
        if (json_is_integer(v) && json_integer_value(v) >= 0) return (long)json_integer_value(v);
        if (json_is_real(v) && json_real_value(v) >= 0 && json_real_value(v) == floor(json_real_value(v)))
            return (long)json_real_value(v);
        return -2;
    }
    return -1;
}

// Parses one trace line into q. PD_OK, or PD_ERR_INVALID with err naming the line.
static pd_status trace_line(const char *line, int line_no, const pd_bench_dataset_params *p,
                            pd_rng *rng, pd_bench_prompt *q, pd_err *err) {
    static const char *const IN[] = {"prompt_len", "input_len", "input_length", NULL};
    static const char *const OUT[] = {"output_len", "output_length", "max_tokens", NULL};
    json_error_t je;
    json_t *o = json_loads(line, 0, &je);
    pd_status st = PD_OK;
    if (!json_is_object(o)) {
        st = pd_err_set(err, PD_ERR_INVALID, "trace line %d: not a JSON object (%s)", line_no, je.text);
        goto done;
    }
    json_t *ts = json_object_get(o, "timestamp");
    if (!json_is_number(ts) || !isfinite(json_number_value(ts))) {
        st = pd_err_set(err, PD_ERR_INVALID, "trace line %d: 'timestamp' (seconds) is required", line_no);
        goto done;
    }
    q->arrival_s = json_number_value(ts);
    long n_out = json_int_field(o, OUT);
    if (n_out < 1) {
        st = pd_err_set(err, PD_ERR_INVALID, "trace line %d: 'output_len' must be a positive integer", line_no);
        goto done;
    }
    q->n_output = (int)n_out;
    json_t *text = json_object_get(o, "prompt");
    if (json_is_string(text)) {
        if (!(q->text = pd_strdup(json_string_value(text)))) st = PD_ERR_NOMEM;
        goto done;
    }
    long n_in = json_int_field(o, IN);
    if (n_in < 1 || n_in > (1 << 24)) {
        st = pd_err_set(err, PD_ERR_INVALID, "trace line %d: needs 'prompt_len' (positive integer) or 'prompt' (text)", line_no);
        goto done;
    }
    if (!(q->ids = pd_malloc((size_t)n_in * sizeof *q->ids))) {
        st = PD_ERR_NOMEM;
        goto done;
    }
    q->n_ids = (int)n_in;
    fill_ids(rng, p, q->ids, q->n_ids);
done:
    json_decref(o);
    return st;
}

static int cmp_arrival(const void *a, const void *b) {
    const pd_bench_prompt *x = a, *y = b;
    return x->arrival_s < y->arrival_s ? -1 : x->arrival_s > y->arrival_s ? 1 : 0;
}

static pd_status load_trace(pd_bench_dataset *d, const pd_bench_dataset_params *p, pd_err *err) {
    char *text = NULL;
    size_t len = 0;
    pd_status st = pd_file_read_all(p->trace_path, &text, &len, err);
    if (st) return st;
    size_t cap = 0;
    int line_no = 0;
    pd_rng rng;
    pd_rng_seed(&rng, p->seed);
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        line_no++;
        char *s = line;
        while (isspace((unsigned char)*s)) s++;
        if (!*s || *s == '#') continue;
        if (p->n_prompts > 0 && d->n >= p->n_prompts) break;
        if (PD_ARRAY_RESERVE(d->prompts, cap, (size_t)d->n + 1) != PD_OK) { st = PD_ERR_NOMEM; break; }
        memset(&d->prompts[d->n], 0, sizeof d->prompts[d->n]);
        st = trace_line(s, line_no, p, &rng, &d->prompts[d->n], err);
        d->n++;  // counted even on failure so that free releases what it holds
        if (st) break;
    }
    pd_free(text);
    if (st) return st == PD_ERR_NOMEM ? pd_err_set(err, st, "trace: out of memory") : st;
    if (d->n == 0) return pd_err_set(err, PD_ERR_INVALID, "trace %s has no requests", p->trace_path);
    qsort(d->prompts, (size_t)d->n, sizeof *d->prompts, cmp_arrival);
    double t0 = d->prompts[0].arrival_s;
    for (int i = 0; i < d->n; i++) d->prompts[i].arrival_s -= t0;
    d->has_arrivals = true;
    return PD_OK;
}

pd_bench_dataset *pd_bench_dataset_new(const pd_bench_dataset_params *p, pd_err *err) {
    if (check_params(p, err)) return NULL;
    pd_bench_dataset *d = pd_calloc(1, sizeof *d);
    if (!d) goto nomem;
    pd_status st;
    if (p->kind == PD_BENCH_DATASET_TRACE) {
        if ((st = load_trace(d, p, err))) goto fail;
        return d;
    }
    if (!(d->prompts = pd_calloc((size_t)p->n_prompts, sizeof *d->prompts))) goto nomem;
    if ((st = generate(d, p))) goto nomem;
    return d;
nomem:
    pd_err_set(err, PD_ERR_NOMEM, "dataset: out of memory");
fail:
    pd_bench_dataset_free(d);
    return NULL;
}

// ---- text prompts for chat -----------------------------------------------------------------------

// Short, common words: each is one token (with its leading space) in Llama 2/3, Mistral and Qwen2.
static const char *const WORDS[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "out", "up", "into", "them",
    "time", "some", "could", "new", "than", "first", "other", "what", "only", "people", "may",
    "like",
};

char *pd_bench_dataset_ids_to_text(const int32_t *ids, int n_ids) {
    size_t cap = 1;
    for (int i = 0; i < n_ids; i++) cap += strlen(WORDS[(uint32_t)ids[i] % PD_ARRAY_LEN(WORDS)]) + 1;
    char *s = pd_malloc(cap);
    if (!s) return NULL;
    size_t k = 0;
    for (int i = 0; i < n_ids; i++) {
        const char *w = WORDS[(uint32_t)ids[i] % PD_ARRAY_LEN(WORDS)];
        if (i) s[k++] = ' ';
        size_t n = strlen(w);
        memcpy(s + k, w, n);
        k += n;
    }
    s[k] = 0;
    return s;
}
