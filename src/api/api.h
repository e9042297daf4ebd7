// api — the OpenAI-compatible HTTP API on top of the serving engine:
//   POST /v1/completions        prompt: string | [token ids] | [strings] | [[token ids]]
//   POST /v1/chat/completions   messages rendered with the model's chat template
//   GET  /v1/models, GET /health, GET /metrics (Prometheus text)
//   POST /internal/tokenize     (router) a completions/chat body → {"token_ids": [...]}
//   GET  /internal/state?since=N (router) load report + KV events (wire/control.h STATE)
// with streaming (SSE chunks in OpenAI's shapes, then `data: [DONE]`) and non-streaming replies.
//
// Pipeline of one request (parse + template + tokenize on the preparation pool, api/prep.h; the
// rest on the HTTP event-loop thread):
//   body ─► pd_api_request_parse (JSON, types, ranges, model name) ─► pd_api_request_tokenize
//   (chat template, tokenizer, context-length check) ─► one engine request per choice
//   (n × prompts) ─► TOKEN events ─► streaming detokenizer ─► stop-string matcher ─► SSE chunk or
//   accumulated text ─► FINISHED (or a stop string: abort the engine request, finish "stop").
// Engine events arrive through pd_engine_event_fd, watched by the same event loop, so no lock is
// ever taken here. A client that disconnects aborts its engine requests; their later events are
// dropped (the id is no longer in the table).
//
// Request policy (documented contract, as vLLM does):
//   * Unknown fields are ignored, so clients that send newer OpenAI fields keep working; known
//     fields with a wrong type or range are a 400 naming the field in error.param.
//   * `model` may be absent; if present it must equal the served model name (else 404
//     model_not_found).
//   * `echo: true`, `best_of` != n / 1 and `suffix` are rejected with 400 (not implemented).
//   * max_tokens absent → the rest of the context (max_model_len - prompt tokens).
//   * n: 1..16 independent samples; with `seed`, choice i uses seed + i.
//   * return_token_ids: true adds "token_ids" (the generated ids) to each choice, and in a
//     stream to each chunk (every generated token's id arrives in exactly one chunk).
//   * priority (vLLM extension): an integer, lower values are scheduled first (default 0).
//   * Stop strings: at most 16, each non-empty; the matched text is not returned.
//   * Chat content may be a string, null, or an array of {"type":"text","text":...} parts (joined
//     with "\n"); other part types are a 400.
//
// Errors are always OpenAI-shaped: {"error": {"message", "type", "param", "code"}}, and the HTTP
// status comes from exactly one function, pd_api_status_http.
//
// Ownership: pd_api borrows the event_base and the engine (both must outlive it). Parsed requests
// own their JSON document; strings in them point into it.
#pragma once

#include <jansson.h>

#include "base/base.h"
#include "engine/engine.h"
#include "tok/chat.h"
#include "tok/tok.h"

#ifdef __cplusplus
extern "C" {
#endif

struct event_base;

#define PD_API_MAX_N 16
#define PD_API_MAX_STOPS 16
#define PD_API_MAX_STOP_IDS 16

// ---- errors ------------------------------------------------------------------------------------

// An API error: the status decides the HTTP status and error.type (pd_api_status_http).
typedef struct pd_api_error {
    pd_status status;
    char param[64];     // the offending field ("" = none: JSON null)
    char message[512];
    const char *code;   // static string or NULL ("model_not_found")
} pd_api_error;

// THE mapping from pd_status to an HTTP status and an OpenAI error type:
//   PD_OK 200 | PD_ERR_INVALID, PD_ERR_PROTO, PD_ERR_UNSUPPORTED 400 invalid_request_error |
//   PD_ERR_NOTFOUND 404 invalid_request_error | PD_NOSPACE, PD_AGAIN 503 server_error
//   (Retry-After) | PD_ERR_TIMEOUT 504 server_error | everything else 500 server_error.
// *type (may be NULL) receives a static string.
int pd_api_status_http(pd_status s, const char **type);

// ---- request parsing (pure: no engine, no I/O) ---------------------------------------------------

typedef enum pd_api_kind {
    PD_API_COMPLETION = 1,
    PD_API_CHAT = 2,
} pd_api_kind;

typedef struct pd_api_request {
    pd_api_kind kind;
    json_t *root;              // owned: the parsed body
    const char *model;         // NULL when absent
    json_t *prompt;            // completions: borrowed from root
    json_t *messages;          // chat: normalised copy (owned): [{role, content: string}, ...]
    int max_tokens;            // -1 = not given (fill to the context)
    int n;                     // 1..PD_API_MAX_N
    bool stream;
    bool include_usage;        // stream_options.include_usage
    bool include_timings;      // "timings": true or stream_options.include_timings: usage.ttft_breakdown
    bool ignore_eos;
    bool skip_special_tokens;  // default true
    bool include_stop_str_in_output;
    bool return_token_ids;     // add "token_ids" to each choice / chunk (used by the router)
    int logprobs;              // -1 = none, else top-N count (chat: top_logprobs when logprobs)
    int priority;
    pd_sampling_params sampling;
    const char *stops[PD_API_MAX_STOPS];  // borrowed from root
    int n_stops;
    int32_t stop_ids[PD_API_MAX_STOP_IDS];  // stop_token_ids (vLLM extension)
    int n_stop_ids;
} pd_api_request;

// Parses and validates a request body for kind. served_model: the name `model` must match (NULL
// = accept any). On success *out owns its document (pd_api_request_fini). On failure *out is
// zeroed and err says why:
//   PD_ERR_INVALID   malformed JSON, wrong type or value (err->param names the field)
//   PD_ERR_NOTFOUND  unknown model (code "model_not_found")
//   PD_ERR_NOMEM
pd_status pd_api_request_parse(pd_api_kind kind, const char *body, size_t len,
                               const char *served_model, pd_api_request *out, pd_api_error *err);
// Frees what a parsed request owns and zeroes it. Safe on a zeroed request.
void pd_api_request_fini(pd_api_request *r);

// The token-level prompts of a request: one per completion prompt (a batch gives several), one
// for chat. max_tokens[i] is the effective limit for prompt i.
typedef struct pd_api_prompts {
    pd_tok_ids *items;  // owned (pd_free), n entries, each owned
    int *max_tokens;    // owned, n entries
    int n;
} pd_api_prompts;

// Turns r's prompt or messages into token ids: chat renders r->messages with tmpl
// (add_generation_prompt = true; the request's "tools" array and "chat_template_kwargs" object,
// when present, reach the template as extra variables) and encodes with add_special=false when the
// rendered text already starts with the BOS token (else true); completion text is encoded with
// add_special=true; token-id prompts are checked against the vocabulary. Then checks each prompt
// against max_model_len: max_tokens < max_model_len (else param "max_tokens" or
// "max_completion_tokens"), prompt alone < max_model_len and prompt + max_tokens <= max_model_len
// (else param "prompt" or "messages"). Errors (PD_ERR_INVALID, PD_ERR_NOMEM): *out is zeroed.
pd_status pd_api_request_tokenize(const pd_api_request *r, const pd_tok *tok,
                                  const pd_chat_template *tmpl, int max_model_len,
                                  pd_api_prompts *out, pd_api_error *err);
void pd_api_prompts_fini(pd_api_prompts *p);

// ---- the server ----------------------------------------------------------------------------------

typedef struct pd_api pd_api;

typedef struct pd_api_params {
    const char *host;               // default "127.0.0.1"
    int port;                       // 0 = any free port
    size_t max_body_bytes;          // default 8 MiB
    const char *served_model_name;  // NULL = pd_engine_model_name()
    int max_connections;            // 0 = from RLIMIT_NOFILE (http.h)
    int keepalive_timeout_s;        // 0 = default (30)
    int header_timeout_s;           // 0 = default (60)
} pd_api_params;
pd_api_params pd_api_params_default(void);

// Starts serving on base with engine e (started by the caller). NULL with err on failure
// (PD_ERR_IO: cannot listen; PD_ERR_INVALID: the model's chat template does not parse — chat
// requests would then fail, so we refuse to start; PD_ERR_NOMEM).
pd_api *pd_api_new(struct event_base *base, pd_engine *e, const pd_api_params *p, pd_err *err);
// Stops listening, aborts every in-flight request (their connections are closed) and frees.
// NULL is a no-op.
void pd_api_free(pd_api *a);
int pd_api_port(const pd_api *a);
const char *pd_api_model_name(const pd_api *a);
// Stops accepting connections; in-flight requests keep going.
void pd_api_stop_accepting(pd_api *a);
// Graceful shutdown (driven by `pdserve serve` on SIGTERM/SIGINT):
//   pd_api_drain: GET /health answers 503 {"status":"draining"}; new generation (POST) requests
//     get 503 + Retry-After (code "draining"); GET /metrics, /v1/models, /internal/state still
//     answer; running requests continue (pd_http_server_drain).
//   pd_api_is_drained: nothing in flight and the last replies written to their sockets.
//   pd_api_end_all: the deadline passed: streams get a final SSE error event (no [DONE]),
//     waiting non-streamed requests a 503; their engine requests are aborted.
void pd_api_drain(pd_api *a, int retry_after_s);
bool pd_api_is_drained(pd_api *a);
void pd_api_end_all(pd_api *a, const char *msg);
// In-flight HTTP requests (jobs) and live engine requests.
int pd_api_n_jobs(const pd_api *a);
int pd_api_n_engine_requests(const pd_api *a);

#ifdef __cplusplus
}
#endif
