// api_impl.h — internals shared by the api/ files: the server state, jobs (one per HTTP request)
// and choices (one per engine request), the id table, and the response-shape builders.
//
//   pd_api ──owns──► api_job (list) ──owns──► api_choice[n_choices]
//      └── id table: engine request id ──► api_choice (only while the engine request is live)
//
// A choice leaves the id table when it finishes (FINISHED event, or a stop string matched and we
// aborted it) or when its client disconnects; events for ids not in the table are dropped. A job
// ends when every choice is done (reply sent) or when its client goes away (nothing sent).
#pragma once

#include <jansson.h>

#include "api/api.h"
#include "base/buf.h"
#include "base/map.h"
#include "grammar/grammar.h"
#include "http/http.h"
#include "metrics/metrics.h"

typedef struct api_job api_job;

enum { TOOL_UNDECIDED = 0, TOOL_CONTENT = 1, TOOL_BUFFER = 2 };

typedef struct api_choice {
    api_job *job;
    int index;            // OpenAI choice index (prompt_idx * n + sample)
    int prompt_idx;
    uint64_t id;          // engine request id
    bool is_live;         // in the id table
    bool is_done;
    const char *finish_reason;  // static: "stop", "length", "abort"
    pd_tok_stream *detok;       // owned
    pd_tok_stop *stop;          // owned; NULL without stop strings
    char *text;                 // non-streaming: accumulated text (owned)
    size_t len, cap;
    json_t *lp;                 // non-streaming logprobs accumulated (owned) or NULL
    size_t text_offset;         // completions logprobs: bytes of text so far
    pd_tok_ids ids;             // non-streaming with return_token_ids: generated ids (owned)
    int32_t cur_id;             // streaming with return_token_ids: the id not yet sent in a chunk
    bool has_cur_id;
    int tool_state;             // tools parsed (job->parse_tools): TOOL_UNDECIDED / _CONTENT / _BUFFER
    json_t *tool_calls;         // parsed at the end (owned) or NULL
    size_t content_len;         // with tool_calls: the text before the first call
    int n_tokens;               // generated tokens seen
    int n_cached;               // prompt tokens served from the prefix cache
    int64_t t_last_us;          // time of the last token
    int spec_method;            // speculative decoding (FINISHED): method, drafts, accepted, steps
    int n_spec_drafted, n_spec_accepted, n_spec_steps;
} api_choice;

struct api_job {
    pd_api *api;
    pd_http_req *http;    // NULL once the client is gone
    pd_api_kind kind;
    bool stream, include_usage, ignore_eos, has_error;
    bool return_ids;      // return_token_ids
    bool parse_tools;     // tools given and tool_choice != none: the text is parsed for calls
    bool tools_forced;    // required / named: the whole text is calls (buffered when streaming)
    pd_api_tool_format tool_fmt;
    json_t *tools;        // a reference to the request's tools (owned ref) or NULL
    int logprobs;         // -1 = none
    int n;                // samples per prompt
    char id[48];          // "cmpl-..." / "chatcmpl-..."
    int64_t created;      // unix seconds
    int64_t t_arrival_us;
    int n_choices, n_done;
    api_choice *choices;  // owned
    int n_prompt_tokens;  // usage.prompt_tokens (each prompt counted once)
    int32_t stop_ids[PD_API_MAX_STOP_IDS + 1];
    int n_stop_ids;
    pd_status error_status;
    char error_msg[256];
    api_job *prev, *next;
    // TTFT breakdown and tracing (timing.c)
    bool include_timings;  // "timings": true / stream_options.include_timings → usage.ttft_breakdown
    bool has_ttft, ttft_remote;
    double ttft_ms[PD_WIRE_N_TTFT_PARTS];
    int64_t t_ttft_sched_us, t_ttft_kv_us, t_ttft_first_us;
    bool is_traced, has_parent_span;
    uint8_t trace_id[16], span_id[8], parent_span_id[8];
};

typedef struct api_metrics {
    pd_metric *ttft, *itl, *e2e;
    pd_metric *running, *waiting;
    pd_metric *kv_total, *kv_free, *kv_used, *kv_cached, *kv_usage;
    pd_metric *prefix_queries, *prefix_hits, *prefix_hit_rate;
    pd_metric *prompt_tokens, *gen_tokens, *prefill_computed, *preemptions, *steps;
    pd_metric *fin_stop, *fin_length, *fin_abort, *fin_error;
    pd_metric *jobs;
    pd_metric *handoffs, *fallbacks[PD_FALLBACK_N], *local_short, *handoff_bytes, *handoff_seconds;
    pd_metric *exports, *export_bytes, *export_copy_seconds, *prefill_healthy;
    pd_metric *decide_local, *decide_remote, *local_a, *local_b;  // link-aware disaggregation
    pd_metric *kvconn[8];  // the KV connector's counters (server.c KVCONN_METRICS)
    pd_metric *ttft_part[PD_WIRE_N_TTFT_PARTS][2];  // [part][local, remote]
    // speculative decoding, by method (index 1.. of PD_ENGINE_SPEC_N; 0 unused)
    pd_metric *spec_drafted[PD_ENGINE_SPEC_N], *spec_accepted[PD_ENGINE_SPEC_N], *spec_emitted[PD_ENGINE_SPEC_N];
    pd_metric *spec_steps[PD_ENGINE_SPEC_N], *spec_rate[PD_ENGINE_SPEC_N], *spec_mal[PD_ENGINE_SPEC_N];
    pd_metric *masks, *mask_seconds;
    // KV tiers (registered on first sight: the engine says which tiers it has)
    bool has_tier_metrics;
    pd_metric *tier_c[PD_ENGINE_MAX_TIERS][7];  // hits misses puts evictions bad_pages bytes_in bytes_out
    pd_metric *tier_g[PD_ENGINE_MAX_TIERS][3];  // bytes_used capacity items
    pd_metric *tier_load[PD_ENGINE_MAX_TIERS];  // load latency histogram (per block)
    int64_t tier_hist_seen[PD_ENGINE_MAX_TIERS][24];
    pd_metric *tier_hit_tokens, *tier_offloads, *tier_offloads_dropped, *tier_promotions, *tier_load_wall;
    pd_metric *tier_remote_notify[5];  // the Redis tier's keyspace notifications (engine.h order)
} api_metrics;

#define API_GCACHE_N 32
typedef struct api_gcache {
    uint64_t hash, last_use;
    char *text;          // owned: the GBNF
    pd_grammar *g;       // a reference
} api_gcache;

typedef struct api_idmap {
    pd_map map;  // base/map.h: {engine request id, choice}; zero until the first put
} api_idmap;

struct pd_api {
    struct event_base *base;
    pd_engine *engine;
    const pd_tok *tok;
    pd_http_server *http;
    pd_chat_template *tmpl;  // owned; NULL if the model has no chat template
    char *model_name;      // owned
    int max_model_len;
    struct event *ev_engine;
    pd_metrics *metrics;   // owned
    api_metrics m;
    api_idmap ids;
    uint64_t next_id;
    uint64_t n_jobs_total;
    pd_rng rng;
    api_job *jobs;
    int n_jobs;
    int64_t n_ttft;                             // first tokens seen (reported in /internal/state)
    double ttft_ms_sum[PD_WIRE_N_TTFT_PARTS];
    struct pd_api_prep *prep;  // owned: parse + template + tokenize off the loop (prep.c)
    // constrained decoding and tools
    pd_grammar_vocab *gvocab;  // owned; NULL if it could not be built (constraints then 400)
    api_gcache gcache[API_GCACHE_N];
    uint64_t gcache_clock;
    pd_api_tool_format tool_fmt;  // of the model's chat template
    int32_t end_ids[16];          // the model's EOS ids and the tokenizer's
    int n_end_ids;
};

// ---- TTFT breakdown and request spans (timing.c) ------------------------------------------------
pd_status pd_api_timing_metrics_init(pd_api *a, pd_err *err);
// Records the breakdown of j's first token (ev: its first TOKEN event, now: when it arrived here).
void pd_api_ttft_note(api_job *j, const pd_engine_event *ev, int64_t now);
// usage.ttft_breakdown (new reference; JSON null before the first token).
json_t *pd_api_ttft_json(const api_job *j);
// Starts j's span (tracing on): under the caller's traceparent header if valid, else a new trace.
void pd_api_trace_begin(api_job *j, const char *traceparent);
// The traceparent naming j's span ("" when not traced), for the engine (→ prefill worker).
void pd_api_trace_traceparent(const api_job *j, char out[56]);
// Exports j's span and its TTFT parts.
void pd_api_trace_end(api_job *j, int64_t now);

// ---- id table (server.c) -----------------------------------------------------------------------
api_choice *pd_api_idmap_get(api_idmap *m, uint64_t id);
pd_status pd_api_idmap_put(api_idmap *m, uint64_t id, api_choice *c);
void pd_api_idmap_del(api_idmap *m, uint64_t id);
void pd_api_idmap_fini(api_idmap *m);

// ---- jobs (job.c) ------------------------------------------------------------------------------
// Handles one engine event (TOKEN or FINISHED).
void pd_api_job_on_event(pd_api *a, const pd_engine_event *ev);
// The client went away: abort live engine requests, forget the ids, free the job.
void pd_api_job_cancel(api_job *j);
// Frees a job (its choices' detokenizers, matchers, buffers) and unlinks it.
void pd_api_job_free(api_job *j);
// Sends the first streaming chunk(s) (chat: the assistant role delta per choice).
void pd_api_job_stream_begin(api_job *j);

// ---- constraints (constrain.c) and tools (tools.c) ---------------------------------------------
// The grammar r's output must follow (a new reference), or *out = NULL when unconstrained.
// Errors fill e (PD_ERR_INVALID: 400 naming response_format / grammar / tools).
pd_status pd_api_constraint(pd_api *a, const pd_api_request *r, pd_grammar **out, pd_api_error *e);
// The ctl of one choice: logit bias and a matcher of g (NULL when neither), resumed after the
// prompt's continuation tokens. PD_ERR_NOMEM, PD_ERR_INVALID (they do not follow g) or PD_OK.
pd_status pd_api_choice_ctl(pd_api *a, const pd_api_request *r, pd_grammar *g, const pd_tok_ids *prompt,
                            pd_sample_ctl **out);
void pd_api_gcache_fini(pd_api *a);
// Token masks computed in this process and the time they took (engine threads), since start.
void pd_api_mask_stats(double *seconds, double *count);
// messages for a template without tool support: the tools described in the (first) system message,
// assistant tool_calls written as <tool_call> text, tool results as <tool_response> user turns.
json_t *pd_api_tools_fallback_messages(const json_t *messages, const json_t *tools);
// GBNF for r's required / named tool choice in format f.
pd_status pd_api_tools_gbnf(const pd_api_request *r, pd_api_tool_format f, char **out, pd_err *err);
// Tool calls in text (OpenAI's tool_calls array, new reference) or NULL when there are none;
// *content_len: the length of the text before the first call.
json_t *pd_api_tools_parse(const char *text, size_t n, pd_api_tool_format f, const json_t *tools, pd_rng *rng,
                           size_t *content_len);
// Whether a reply whose first non-blank character is c may be a tool call in format f.
bool pd_api_tools_may_open(pd_api_tool_format f, char c);

// ---- response shapes (response.c) --------------------------------------------------------------
// usage object of a job (completion tokens summed over choices).
json_t *pd_api_usage_json(const api_job *j);
// One streaming chunk for choice c: text (may be empty), lp (stolen; NULL = "logprobs": null),
// finish (NULL = null), ids (n_ids >= 0: a "token_ids" array; n_ids < 0: none).
json_t *pd_api_chunk_json(const api_job *j, const api_choice *c, const char *text, size_t len,
                          json_t *lp, const char *finish, const int32_t *ids, int n_ids);
// A streaming chunk whose delta carries tool call k of choice c (call: {"id","type","function"}).
json_t *pd_api_tool_call_chunk_json(const api_job *j, const api_choice *c, int k, const json_t *call);
// The streaming usage chunk (choices: []).
json_t *pd_api_usage_chunk_json(const api_job *j);
// The whole non-streaming response.
json_t *pd_api_response_json(const api_job *j);
// Logprob entry for one sampled token, in the job's shape; appended to *acc (created on demand).
//   completions: acc = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
//   chat:        acc = {"content": [{token, logprob, bytes, top_logprobs}]}
pd_status pd_api_logprobs_append(const api_job *j, const pd_tok *tok, const pd_sample_result *r,
                                  size_t text_offset, json_t **acc);
