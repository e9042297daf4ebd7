// bench.c — `pdserve bench` (load an OpenAI-compatible server and report latency/throughput) and
// `pdserve bench merge` (one HTML report from several JSON results).
//
// Flow: flags → pd_bench_dataset_new → pd_bench_run once per rate (--sweep-rates) → summary
// tables on stdout → --output-json (the document) → --output-html / --output-svg-dir (built from
// that same document, exactly as `merge` does from files).
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench/bench.h"
#include "cmd/cmd.h"

#define MAX_RATES 64

typedef struct bench_opts {
    pd_bench_params p;
    pd_bench_dataset_params d;
    const char *label;
    const char *output_json, *output_html, *output_svg_dir;
    double rates[MAX_RATES];
    int n_rates;
    bool is_quiet;
} bench_opts;

static void bench_usage(void) {
    printf(
        "usage: pdserve bench [options]           benchmark an OpenAI-compatible server\n"
        "       pdserve bench merge [--output-html F] [--output-svg-dir D] [--goodput SLOS] a.json b.json ...\n"
        "         (one report from earlier --output-json files; --goodput recomputes goodput for other SLOs)\n\n"
        "target:\n"
        "  --url URL                 server base URL (default http://127.0.0.1:8000)\n"
        "  --endpoint PATH           /v1/completions (default) or /v1/chat/completions\n"
        "  --model NAME              model name (default: the first of GET /v1/models)\n"
        "  --api-key KEY             sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)\n"
        "load:\n"
        "  --num-prompts N           requests to send (default 100)\n"
        "  --request-rate R          requests/s, or inf = all at once (default inf)\n"
        "  --burstiness B            gamma shape of the gaps; 1 = Poisson (default 1)\n"
        "  --max-concurrency C       at most C requests in flight (closed loop when rate is inf)\n"
        "  --sweep-rates R1,R2,...   one benchmark per rate (replaces --request-rate)\n"
        "  --max-connections N       connection pool (default: max-concurrency, else 256)\n"
        "  --request-timeout-s S     per request (default 600)\n"
        "  --timeout-s S             whole benchmark; then in-flight requests are cancelled (default 3600)\n"
        "  --seed N                  prompts and arrivals (default 0)\n"
        "  --num-warmups N           requests sent and awaited before measuring (default 0)\n"
        "dataset:\n"
        "  --dataset random|shared-prefix|long-mix|trace   (default random)\n"
        "  --input-len I --output-len O --range-ratio X     random (default 1024, 128, 0)\n"
        "  --prefix-len P --num-prefixes N --suffix-len S   shared-prefix (default 512, 4, 128)\n"
        "  --long-fraction F --long-len L --short-len S     long-mix (default 0.2, 8192, 512)\n"
        "  --trace FILE              JSONL: {\"timestamp\": s, \"prompt_len\": n | \"prompt\": text, \"output_len\": n}\n"
        "  --token-id-min N --token-id-max N   prompt token ids are drawn from [min, max) (default 100, 4000)\n"
        "  --vocab-size N            same as --token-id-max N\n"
        "report:\n"
        "  --goodput ttft:MS tpot:MS [e2e:MS]   SLOs for goodput (requests/s meeting all of them)\n"
        "  --label NAME              name of this configuration in reports (default pdserve)\n"
        "  --output-json FILE        all metrics and per-request records\n"
        "  --output-html FILE        self-contained HTML report with SVG charts\n"
        "  --output-svg-dir DIR      each chart as a standalone .svg\n"
        "  --quiet                   no progress lines on stderr (one every 5 s otherwise)\n"
        "  --return-token-ids        ask for token ids in every chunk (pdserve): times every token,\n"
        "                            even those whose text is empty (dummy weights, small tokenizers)\n");
}

// Parses "1,2,4,inf". false on error.
static bool parse_rates(const char *s, bench_opts *o) {
    o->n_rates = 0;
    const char *p = s;
    while (*p) {
        if (o->n_rates == MAX_RATES) return false;
        char *end;
        double v;
        if (!strncmp(p, "inf", 3)) v = INFINITY, end = (char *)p + 3;
        else v = strtod(p, &end);
        if (end == p || !(v > 0)) return false;
        o->rates[o->n_rates++] = v;
        p = end;
        if (*p == ',') p++;
        else if (*p) return false;
    }
    return o->n_rates > 0;
}

static bool parse_rate(const char *s, double *out) {
    if (!strcmp(s, "inf") || !strcmp(s, "infinity")) return *out = INFINITY, true;
    return pd_cmd_parse_float(s, out) && *out > 0;
}

static bool parse_i(const char *s, int *out, long lo) {
    long v;
    if (!pd_cmd_parse_int(s, &v) || v < lo || v > (1L << 30)) return false;
    *out = (int)v;
    return true;
}

// Applies one flag. Returns 0, or the exit code for an error. *i is advanced past consumed values.
static int apply_flag(bench_opts *o, const char *name, const char *val, int argc, char **argv, int *i) {
    long l;
    bool ok = true;
#define IS(s) (!strcmp(name, s))
    if (IS("url")) o->p.base_url = val;
    else if (IS("endpoint")) o->p.endpoint = val;
    else if (IS("model")) o->p.model = val;
    else if (IS("num-prompts")) ok = parse_i(val, &o->d.n_prompts, 1);
    else if (IS("request-rate")) ok = parse_rate(val, &o->rates[0]), o->n_rates = 1;
    else if (IS("burstiness")) ok = pd_cmd_parse_float(val, &o->p.burstiness) && o->p.burstiness > 0;
    else if (IS("max-concurrency")) ok = parse_i(val, &o->p.max_concurrency, 1);
    else if (IS("max-connections")) ok = parse_i(val, &o->p.max_connections, 1);
    else if (IS("sweep-rates")) ok = parse_rates(val, o);
    else if (IS("request-timeout-s")) ok = pd_cmd_parse_float(val, &o->p.request_timeout_s) && o->p.request_timeout_s > 0;
    else if (IS("timeout-s")) ok = pd_cmd_parse_float(val, &o->p.timeout_s) && o->p.timeout_s > 0;
    else if (IS("seed")) ok = pd_cmd_parse_int(val, &l) && l >= 0, o->d.seed = o->p.seed = (uint64_t)l;
    else if (IS("dataset")) ok = (o->d.kind = pd_bench_dataset_kind_parse(val)) != 0;
    else if (IS("input-len")) ok = parse_i(val, &o->d.input_len, 1);
    else if (IS("output-len")) ok = parse_i(val, &o->d.output_len, 1);
    else if (IS("range-ratio")) ok = pd_cmd_parse_float(val, &o->d.range_ratio);
    else if (IS("prefix-len")) ok = parse_i(val, &o->d.prefix_len, 0);
    else if (IS("num-prefixes")) ok = parse_i(val, &o->d.n_prefixes, 1);
    else if (IS("suffix-len")) ok = parse_i(val, &o->d.suffix_len, 0);
    else if (IS("long-fraction")) ok = pd_cmd_parse_float(val, &o->d.long_fraction);
    else if (IS("long-len")) ok = parse_i(val, &o->d.long_len, 1);
    else if (IS("short-len")) ok = parse_i(val, &o->d.short_len, 1);
    else if (IS("trace")) o->d.trace_path = val;
    else if (IS("token-id-min")) ok = parse_i(val, &o->d.token_id_min, 0);
    else if (IS("token-id-max") || IS("vocab-size")) ok = parse_i(val, &o->d.token_id_max, 1);
    else if (IS("label")) o->label = val;
    else if (IS("api-key")) o->p.api_key = val;
    else if (IS("num-warmups")) ok = parse_i(val, &o->p.n_warmup, 0);
    else if (IS("output-json")) o->output_json = val;
    else if (IS("output-html")) o->output_html = val;
    else if (IS("output-svg-dir")) o->output_svg_dir = val;
    else if (IS("goodput")) {
        // vLLM style: --goodput ttft:200 tpot:50 (several words) or one quoted/comma list.
        char buf[512];
        snprintf(buf, sizeof buf, "%s", val);
        while (*i + 1 < argc && strncmp(argv[*i + 1], "--", 2) && strchr(argv[*i + 1], ':')) {
            size_t n = strlen(buf);
            snprintf(buf + n, sizeof buf - n, " %s", argv[++*i]);
        }
        pd_err err = {0};
        if (pd_bench_slo_parse(buf, &o->p.slo, &err)) return pd_cmd_usage_error("bench", "%s", err.msg);
    } else return pd_cmd_usage_error("bench", "unknown option --%s (see --help)", name);
#undef IS
    if (!ok) return pd_cmd_usage_error("bench", "bad value '%s' for --%s", val, name);
    return 0;
}

// Returns -1 on success, else the exit code.
static int parse_flags(int argc, char **argv, bench_opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage();
            return 0;
        }
        if (!strcmp(a, "--return-token-ids")) {
            o->p.return_token_ids = true;
            continue;
        }
        if (!strcmp(a, "--quiet")) {
            o->is_quiet = true;
            continue;
        }
        if (strncmp(a, "--", 2)) return pd_cmd_usage_error("bench", "unexpected argument '%s'", a);
        char name[64];
        const char *eq = strchr(a, '='), *val;
        if (eq) {
            snprintf(name, sizeof name, "%.*s", (int)(eq - a - 2), a + 2);
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a + 2);
            if (i + 1 >= argc) return pd_cmd_usage_error("bench", "--%s needs a value", name);
            val = argv[++i];
        }
        int rc = apply_flag(o, name, val, argc, argv, &i);
        if (rc) return rc;
    }
    if (o->d.kind == PD_BENCH_DATASET_TRACE && o->n_rates > 1)
        return pd_cmd_usage_error("bench", "--sweep-rates does not apply to --dataset trace (its timestamps set the rate)");
    return -1;
}

static void print_sweep_table(pd_bench_result *const *runs, int n) {
    printf("\n%-10s %10s %12s %12s %12s %12s %10s %8s\n", "rate", "req/s", "out tok/s", "p99 TTFT ms",
           "p99 TPOT ms", "p99 E2E ms", "goodput", "failed");
    for (int i = 0; i < n; i++) {
        const pd_bench_metrics *m = &runs[i]->metrics;
        char rate[32];
        if (isfinite(runs[i]->request_rate)) snprintf(rate, sizeof rate, "%g", runs[i]->request_rate);
        else snprintf(rate, sizeof rate, "inf");
        printf("%-10s %10.2f %12.1f %12.2f %12.2f %12.2f %10.2f %8d\n", rate, m->request_throughput,
               m->output_throughput, m->ttft_ms.p99, m->tpot_ms.p99, m->e2e_ms.p99, m->goodput, m->n_failed);
    }
}

// Writes the JSON, HTML and SVG outputs of doc. Returns the exit code.
static int write_outputs(json_t *doc, const char *json_path, const char *html_path, const char *svg_dir) {
    if (json_path && json_dump_file(doc, json_path, JSON_INDENT(1) | JSON_REAL_PRECISION(10)) != 0) {
        fprintf(stderr, "pdserve bench: cannot write %s: %s\n", json_path, strerror(errno));
        return 1;
    }
    if (!html_path && !svg_dir) return 0;
    pd_err err = {0};
    char *html = NULL;
    if (pd_bench_report_build(&doc, 1, html_path ? &html : NULL, svg_dir, &err) ||
        (html_path && pd_bench_report_write_file(html_path, html, &err))) {
        fprintf(stderr, "pdserve bench: %s\n", err.msg);
        pd_free(html);
        return 1;
    }
    pd_free(html);
    return 0;
}

static int bench_merge(int argc, char **argv) {
    const char *html_path = NULL, *svg_dir = NULL;
    pd_bench_slo slo = {0};
    json_t *docs[256];
    int n_docs = 0, rc = 0;
    for (int i = 1; i < argc && rc == 0; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            bench_usage();
            goto done;
        }
        if (!strcmp(argv[i], "--output-html") && i + 1 < argc) html_path = argv[++i];
        else if (!strcmp(argv[i], "--output-svg-dir") && i + 1 < argc) svg_dir = argv[++i];
        else if (!strcmp(argv[i], "--goodput") && i + 1 < argc) {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) && strchr(argv[i + 1], ':') && !strstr(argv[i + 1], ".json")) {
                size_t n = strlen(buf);
                snprintf(buf + n, sizeof buf - n, " %s", argv[++i]);
            }
            pd_err err = {0};
            if (pd_bench_slo_parse(buf, &slo, &err)) rc = pd_cmd_usage_error("bench merge", "%s", err.msg);
        }
        else if (!strncmp(argv[i], "--", 2)) rc = pd_cmd_usage_error("bench merge", "unknown option %s", argv[i]);
        else if (n_docs == (int)PD_ARRAY_LEN(docs)) rc = pd_cmd_usage_error("bench merge", "too many files");
        else {
            json_error_t je;
            pd_err err = {0};
            json_t *d = json_load_file(argv[i], 0, &je);
            if (!d) {
                fprintf(stderr, "pdserve bench merge: %s: %s (line %d)\n", argv[i], je.text, je.line);
                rc = 1;
            } else if (pd_bench_result_check_json(d, &err)) {
                fprintf(stderr, "pdserve bench merge: %s: %s\n", argv[i], err.msg);
                json_decref(d);
                rc = 1;
            } else {
                docs[n_docs++] = d;
            }
        }
    }
    if (rc == 0 && n_docs == 0) rc = pd_cmd_usage_error("bench merge", "give at least one JSON result file");
    if (rc == 0 && !html_path && !svg_dir) rc = pd_cmd_usage_error("bench merge", "give --output-html and/or --output-svg-dir");
    for (int i = 0; rc == 0 && pd_bench_slo_is_set(&slo) && i < n_docs; i++) {
        pd_err err = {0};
        if (pd_bench_result_apply_slo(docs[i], &slo, &err)) rc = pd_cmd_usage_error("bench merge", "%s", err.msg);
    }
    if (rc == 0) {
        pd_err err = {0};
        char *html = NULL;
        if (pd_bench_report_build(docs, n_docs, html_path ? &html : NULL, svg_dir, &err) ||
            (html_path && pd_bench_report_write_file(html_path, html, &err))) {
            fprintf(stderr, "pdserve bench merge: %s\n", err.msg);
            rc = 1;
        } else if (html_path) {
            printf("wrote %s (%d configurations)\n", html_path, n_docs);
        }
        pd_free(html);
    }
done:
    for (int i = 0; i < n_docs; i++) json_decref(docs[i]);
    return rc;
}

static void print_progress(const pd_bench_progress *p, void *ud) {
    if (p->is_final) {
        fprintf(stderr, "pdserve bench: done in %.1f s: %d requests, %d failed\n", p->elapsed_s, p->n_total, p->n_failed);
        return;
    }
    fprintf(stderr, "pdserve bench: %6.1f s  sent %d/%d  in flight %d  done %d  failed %d\n", p->elapsed_s, p->n_sent,
            p->n_total, p->n_in_flight, p->n_done, p->n_failed);
}

int pd_cmd_bench(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "merge")) return bench_merge(argc - 1, argv + 1);
    bench_opts o = {.p = pd_bench_params_default(), .d = pd_bench_dataset_params_default(), .label = "pdserve"};
    o.p.base_url = "http://127.0.0.1:8000";
    o.rates[0] = INFINITY;
    o.n_rates = 1;
    const char *env_key = getenv("OPENAI_API_KEY");
    if (env_key && *env_key) o.p.api_key = env_key;
    int rc = parse_flags(argc, argv, &o);
    if (rc >= 0) return rc;
    if (!o.is_quiet) o.p.on_progress = print_progress;
    // One socket per connection: lift the soft descriptor limit (often 1024) to the hard one so
    // that a large --max-concurrency does not fail on connect.
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    size_t n = strlen(o.p.base_url);
    static char url[2048];
    snprintf(url, sizeof url, "%.*s", (int)(n && o.p.base_url[n - 1] == '/' ? n - 1 : n), o.p.base_url);
    o.p.base_url = url;  // no trailing slash: the endpoint brings its own
    if (o.d.kind == PD_BENCH_DATASET_TRACE && o.d.n_prompts == pd_bench_dataset_params_default().n_prompts)
        o.d.n_prompts = 0;  // a trace replays every line unless --num-prompts says otherwise
    pd_err err = {0};
    pd_bench_dataset *ds = pd_bench_dataset_new(&o.d, &err);
    if (!ds) return pd_cmd_usage_error("bench", "%s", err.msg);
    pd_bench_result *runs[MAX_RATES] = {0};
    int n_runs = 0;
    rc = 0;
    for (int i = 0; i < o.n_rates; i++) {
        o.p.request_rate = o.rates[i];
        if (!o.is_quiet)
            fprintf(stderr, "pdserve bench: %d requests to %s%s at %g req/s%s\n", ds->n, o.p.base_url,
                    o.p.endpoint, o.p.request_rate, ds->has_arrivals ? " (trace timestamps)" : "");
        if (pd_bench_run(&o.p, ds, &runs[n_runs], &err)) {
            fprintf(stderr, "pdserve bench: %s\n", err.msg);
            rc = 1;
            break;
        }
        if (!o.p.model) o.p.model = runs[0]->model;  // ask /v1/models once per sweep
        char *s = pd_bench_result_summary(runs[n_runs], &o.p.slo, o.label);
        if (s) fputs(s, stdout);
        pd_free(s);
        fflush(stdout);
        n_runs++;
    }
    if (n_runs > 1) print_sweep_table(runs, n_runs);
    if (n_runs > 0 && (o.output_json || o.output_html || o.output_svg_dir)) {
        pd_bench_config cfg = {.label = o.label, .params = &o.p, .dataset = &o.d};
        json_t *doc = pd_bench_result_to_json(&cfg, runs, n_runs);
        if (!doc) {
            fprintf(stderr, "pdserve bench: out of memory building the JSON\n");
            rc = 1;
        } else {
            int wrc = write_outputs(doc, o.output_json, o.output_html, o.output_svg_dir);
            if (wrc) rc = wrc;
            json_decref(doc);
        }
    }
    for (int i = 0; i < n_runs; i++) pd_bench_result_free(runs[i]);
    pd_bench_dataset_free(ds);
    return rc;
}
