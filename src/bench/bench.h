// bench — the serving benchmark behind `pdserve bench`: a load generator for any OpenAI-compatible
// server (in the spirit of `vllm bench serve`), its statistics and its reports.
//
// Pieces, in the order data flows:
//   dataset.c  pd_bench_dataset: the requests to send (prompt as token ids or text, output length)
//              and their arrival offsets (gamma/Poisson, all at once, or a trace's timestamps).
//              Pure and seeded: the same flags give the same prompts and the same schedule.
//   run.c      pd_bench_run: one event loop, one pd_http_client with a bounded pool; sends every
//              request at its arrival time (open loop) or whenever fewer than max_concurrency are
//              in flight (closed loop), reads the SSE stream and times every content chunk.
//   stats.c    pure statistics: numpy-style percentiles, mean/std, TPOT, goodput, throughput.
//   result.c   a run's records and metrics as JSON (the --output-json document) and as the human
//              summary table.
//   svg.c      line charts as self-contained SVG text.
//   report.c   the HTML report (and standalone .svg files) built from one or more JSON documents,
//              so a single run, a sweep and `bench merge` of several configurations share one path.
//
// Definitions (per request, all in milliseconds; docs/bench.md has the long form):
//   TTFT  first content chunk − request sent; "sent" is when the request is handed to the HTTP
//         client: at its arrival time (open loop), or when a slot frees up under max_concurrency.
//         Waiting for a pooled connection after that counts.
//   ITL   every gap between consecutive content chunks
//   TPOT  (E2E − TTFT) / (output tokens − 1), only for requests with ≥ 2 output tokens
//   E2E   end of the response − request sent
//   output tokens: usage.completion_tokens when the server reports it, else content chunks
// A request succeeds when the server answers 200, the stream carries no error object and at
// least one content chunk arrived.
//
// Threads: a run uses the calling thread only. Ownership is noted at each declaration.
#pragma once

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_BENCH_JSON_VERSION 1

// ---- statistics (stats.c, pure) ------------------------------------------------------------------

// The summary of one latency distribution. All NAN when n == 0.
typedef struct pd_bench_dist {
    size_t n;
    double mean, std, min, max, median, p90, p99, p999;
} pd_bench_dist;

// Service-level objectives for goodput; a value <= 0 means "not given".
typedef struct pd_bench_slo {
    double ttft_ms, tpot_ms, e2e_ms;
} pd_bench_slo;

// One request's outcome (filled by run.c, read by stats and reports).
typedef struct pd_bench_record {
    int idx;                 // position in the dataset
    double start_s;          // send time, seconds since the run started
    bool is_ok;
    int http_status;         // 0 if no response
    char *error;             // owned; NULL when ok
    int n_prompt_tokens;     // usage.prompt_tokens, else the dataset's length (0 if unknown)
    int n_output_tokens;
    int n_chunks;            // content chunks received
    double ttft_ms, tpot_ms, e2e_ms;  // NAN when not defined
    double *itl_ms;          // owned: n_itl inter-chunk gaps
    int n_itl;
} pd_bench_record;

// Aggregates of one run.
typedef struct pd_bench_metrics {
    int n_completed, n_failed;
    double duration_s;
    int64_t n_input_tokens, n_output_tokens;  // over completed requests
    double request_throughput;      // completed / duration
    double output_throughput;       // output tokens / s
    double total_token_throughput;  // (input + output) tokens / s
    int n_good;                     // completed requests meeting every given SLO
    double goodput;                 // n_good / duration (req/s); NAN when no SLO is given
    pd_bench_dist ttft_ms, tpot_ms, itl_ms, e2e_ms;
} pd_bench_metrics;

// Percentile q in [0, 100] of n sorted values, interpolating linearly between the two nearest
// ranks (numpy's default "linear" method): pos = q/100 * (n-1). NAN when n == 0.
double pd_bench_stats_percentile(const double *sorted, size_t n, double q);
// Mean and population standard deviation (numpy's std, ddof=0). NAN when n == 0.
double pd_bench_stats_mean(const double *v, size_t n);
double pd_bench_stats_std(const double *v, size_t n);
// Summarises v (not modified; NAN entries are skipped). PD_OK or PD_ERR_NOMEM.
pd_status pd_bench_stats_dist(const double *v, size_t n, pd_bench_dist *out);
// TPOT of one request: (e2e - ttft) / (n_output - 1); NAN when n_output < 2.
double pd_bench_stats_tpot(double ttft_ms, double e2e_ms, int n_output_tokens);
// Whether a completed request meets every given SLO (a NAN TPOT meets a TPOT SLO: a one-token
// answer has no decode phase).
bool pd_bench_stats_meets_slo(const pd_bench_slo *slo, const pd_bench_record *r);
bool pd_bench_slo_is_set(const pd_bench_slo *slo);
// Parses "ttft:200 tpot:50 e2e:3000" (space or comma separated, any subset, ms). PD_ERR_INVALID.
pd_status pd_bench_slo_parse(const char *s, pd_bench_slo *out, pd_err *err);
// All aggregates of a run. PD_OK or PD_ERR_NOMEM.
pd_status pd_bench_stats_compute(const pd_bench_record *recs, size_t n, double duration_s,
                                 const pd_bench_slo *slo, pd_bench_metrics *out);

// ---- datasets (dataset.c) -----------------------------------------------------------------------

typedef enum pd_bench_dataset_kind {
    PD_BENCH_DATASET_RANDOM = 1,
    PD_BENCH_DATASET_SHARED_PREFIX = 2,
    PD_BENCH_DATASET_LONG_MIX = 3,
    PD_BENCH_DATASET_TRACE = 4,
} pd_bench_dataset_kind;

typedef struct pd_bench_dataset_params {
    pd_bench_dataset_kind kind;
    int n_prompts;           // trace: 0 = every line
    uint64_t seed;
    int token_id_min, token_id_max;  // prompt ids are drawn from [min, max); default [100, 4000)
    // random
    int input_len, output_len;
    double range_ratio;      // lengths uniform in [len*(1-r), len*(1+r)]; 0 = exact
    // shared-prefix
    int prefix_len, n_prefixes, suffix_len;
    // long-mix
    double long_fraction;
    int long_len, short_len;
    // trace
    const char *trace_path;  // borrowed for the call
} pd_bench_dataset_params;
pd_bench_dataset_params pd_bench_dataset_params_default(void);

typedef struct pd_bench_prompt {
    int32_t *ids;        // owned: the prompt as token ids (n_ids), or NULL when text is used
    int n_ids;
    char *text;          // owned: the prompt as text (trace lines with "prompt"), else NULL
    int n_output;        // max_tokens
    double arrival_s;    // trace timestamp (relative to the first); 0 for generated sets
} pd_bench_prompt;

typedef struct pd_bench_dataset {
    pd_bench_prompt *prompts;  // owned: n
    int n;
    bool has_arrivals;         // a trace: use arrival_s instead of generated arrivals
} pd_bench_dataset;

// Builds the dataset. out: owned by caller (pd_bench_dataset_free). NULL with err: PD_ERR_INVALID
// (bad lengths, bad trace line: err names the line), PD_ERR_NOTFOUND/PD_ERR_IO (trace file),
// PD_ERR_NOMEM.
pd_bench_dataset *pd_bench_dataset_new(const pd_bench_dataset_params *p, pd_err *err);
void pd_bench_dataset_free(pd_bench_dataset *d);  // NULL is a no-op
// "random" → PD_BENCH_DATASET_RANDOM, ...; 0 if unknown.
pd_bench_dataset_kind pd_bench_dataset_kind_parse(const char *s);
const char *pd_bench_dataset_kind_name(pd_bench_dataset_kind k);

// Arrival offsets (seconds from the start, non-decreasing) of n requests at `rate` req/s with
// gamma-distributed gaps of shape `burstiness` (1 = Poisson; < 1 burstier, > 1 more regular)
// and mean 1/rate. rate <= 0 or infinite: all 0. out: caller-provided, n entries.
void pd_bench_dataset_arrivals(int n, double rate, double burstiness, uint64_t seed, double *out);
// One gamma(shape, scale) sample (Marsaglia-Tsang). Exposed for tests.
double pd_bench_dataset_gamma(pd_rng *rng, double shape, double scale);

// Chat endpoints take text, not ids: a deterministic text of about n_tokens tokens (common
// English words, one token each in Llama vocabularies) built from ids. out: owned by caller
// (pd_free); NULL on OOM.
char *pd_bench_dataset_ids_to_text(const int32_t *ids, int n_ids);

// ---- the load generator (run.c) -----------------------------------------------------------------

struct pd_bench_progress;

typedef struct pd_bench_params {
    const char *base_url;      // "http://127.0.0.1:8000" (borrowed)
    const char *endpoint;      // "/v1/completions" or "/v1/chat/completions" (borrowed)
    const char *model;         // borrowed; NULL = ask GET /v1/models (the first id)
    double request_rate;       // req/s; <= 0 or inf = all at once
    double burstiness;         // gamma shape (1 = Poisson)
    int max_concurrency;       // 0 = unlimited
    int max_connections;       // 0 = max_concurrency, or 256 when unlimited
    double request_timeout_s;  // per request (default 600)
    double timeout_s;          // whole run: then everything still in flight is cancelled (default 3600)
    uint64_t seed;             // arrival schedule
    pd_bench_slo slo;
    const char *api_key;       // borrowed; NULL = none, else sent as "Authorization: Bearer <key>"
    int n_warmup;              // requests sent (all at once, bounded by max_concurrency) and awaited
                               // before the clock starts; not recorded
    // (optional) called on the loop thread every progress_interval_s (default 5) while the run
    // goes on, and once at the end. p is valid during the call.
    void (*on_progress)(const struct pd_bench_progress *p, void *ud);
    void *progress_ud;
    double progress_interval_s;
    bool is_chat;              // derived from endpoint by pd_bench_run
    bool return_token_ids;     // ask for "return_token_ids" (pdserve extension): every token then
                               // arrives as a chunk carrying its id, even when its text is empty,
                               // so TTFT/ITL are timed per token whatever the tokenizer decodes
} pd_bench_params;

typedef struct pd_bench_progress {
    double elapsed_s;
    int n_total, n_sent, n_in_flight, n_done, n_failed;
    bool is_final;
} pd_bench_progress;
pd_bench_params pd_bench_params_default(void);

typedef struct pd_bench_result {
    double request_rate;       // as asked (INFINITY for all at once)
    double burstiness;
    int max_concurrency;
    char *model;               // owned: the model name used
    pd_bench_record *records;  // owned: one per prompt, dataset order
    int n_records;
    pd_bench_metrics metrics;
} pd_bench_result;

// Runs one benchmark of ds against the server, on a new event loop on the calling thread.
// Returns PD_OK with *out (owned by caller, pd_bench_result_free) even when requests failed (see
// metrics.n_failed); an error only when the run could not happen: PD_ERR_INVALID (bad URL or
// params), PD_ERR_IO (model discovery failed: err says why), PD_ERR_NOMEM.
pd_status pd_bench_run(const pd_bench_params *p, const pd_bench_dataset *ds, pd_bench_result **out,
                       pd_err *err);
void pd_bench_result_free(pd_bench_result *r);  // NULL is a no-op

// ---- results (result.c) ---------------------------------------------------------------------------

// Everything about the run that is not a measurement, recorded in the JSON "config" object.
typedef struct pd_bench_config {
    const char *label;       // borrowed
    const pd_bench_params *params;
    const pd_bench_dataset_params *dataset;
} pd_bench_config;

// The --output-json document: {"pdserve_bench_version", "label", "config", "runs": [{"request_rate",
// "burstiness", "max_concurrency", "model", "metrics", "requests": [...]}, ...]}.
// New reference owned by the caller; NULL on OOM.
json_t *pd_bench_result_to_json(const pd_bench_config *cfg, pd_bench_result *const *runs, int n_runs);
// The metrics object of one run (also inside the document). New reference; NULL on OOM.
json_t *pd_bench_metrics_to_json(const pd_bench_metrics *m);
// The human summary of one run (vllm-style table). out: owned by caller (pd_free); NULL on OOM.
char *pd_bench_result_summary(const pd_bench_result *r, const pd_bench_slo *slo, const char *label);
// Recomputes "good_requests" and "goodput" of every run of doc (in place) for other SLOs, from the
// per-request records, and records slo in config.goodput (`bench merge --goodput`).
// PD_OK, PD_ERR_INVALID (not a bench document) or PD_ERR_NOMEM.
pd_status pd_bench_result_apply_slo(json_t *doc, const pd_bench_slo *slo, pd_err *err);
// Checks that a parsed document has the shape of pd_bench_result_to_json's (for merge).
// PD_OK or PD_ERR_INVALID with err.
pd_status pd_bench_result_check_json(const json_t *doc, pd_err *err);

// ---- charts and report (svg.c, report.c) -----------------------------------------------------------

typedef struct pd_bench_svg_series {
    const char *name;    // borrowed
    const double *x, *y; // borrowed, n points
    int n;
    const char *color;   // borrowed, CSS color ("#1f77b4")
    double opacity;      // line opacity in (0, 1]; 0 means 1
    bool is_dashed;
    bool has_markers;
    bool is_scatter;     // markers only, no line
} pd_bench_svg_series;

typedef struct pd_bench_svg_chart {
    const char *title, *x_label, *y_label;  // borrowed
    const pd_bench_svg_series *series;      // borrowed
    int n_series;
    int width, height;                      // pixels (default 640 x 400 when 0)
    bool is_log_x;                          // log10 x axis (positive x only)
    bool is_step;                           // draw as a step function (CDFs)
} pd_bench_svg_chart;

// Renders a line chart as a standalone <svg> element (with xmlns, so it is also a valid .svg file).
// out: owned by caller (pd_free); NULL on OOM.
char *pd_bench_svg_render(const pd_bench_svg_chart *chart);
// The color of series i in the report's palette (static string).
const char *pd_bench_svg_color(int i);

// Builds the report from n_docs benchmark documents (borrowed): the HTML text (NULL if not wanted)
// and, when svg_dir is not NULL, one <name>.svg per chart written there (the directory is created).
// html_out: owned by caller (pd_free). PD_OK, PD_ERR_INVALID (a document of the wrong shape),
// PD_ERR_IO (svg_dir), PD_ERR_NOMEM.
pd_status pd_bench_report_build(json_t *const *docs, int n_docs, char **html_out,
                                const char *svg_dir, pd_err *err);
// Writes text to path. PD_OK or PD_ERR_IO with err.
pd_status pd_bench_report_write_file(const char *path, const char *text, pd_err *err);

#ifdef __cplusplus
}
#endif
