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
// Request policy (documented contract):
//   * Every field is known or refused. Fields that change the output are implemented or a 400
//     naming them (error.param); fields that change nothing here are accepted: `user`, `metadata`,
//     `store`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `modalities: ["text"]`.
//     OpenAI fields we do not implement (`audio`, `prediction`, `reasoning_effort`,
//     `web_search_options`, `verbosity`, the deprecated `functions` / `function_call`) are a 400
//     saying so, and a field nobody defines is a 400 "Unrecognized request argument supplied"
//     (OpenAI's own behaviour; vLLM ignores unknown fields unless strict, which lets a typo in
//     `respose_format` silently return unconstrained text). A field added here must be added to
//     the tables at the top of request.c. Known fields with a wrong type or range are a 400 too.
//   * response_format: {"type":"text"} | {"type":"json_object"} (any JSON object) |
//     {"type":"json_schema","json_schema":{"name","schema","strict"}} (the grammar/ subset; a
//     schema keyword we cannot enforce is a 400 naming it; the schema is enforced whether strict
//     is true or not). `grammar` (llama.cpp's field): a GBNF grammar string. Either constrains
//     decoding with a token mask: the text always follows the grammar, EOS is allowed only where
//     the grammar may end, and a sequence cut by max_tokens ends with finish_reason "length"
//     (then the text is a prefix of a valid output, as OpenAI's). Not with ignore_eos (400).
//   * tools / tool_choice ("none" | "auto" | "required" | {"type":"function","function":{"name"}})
//     / parallel_tool_calls: the model's tool-call syntax (pd_api_tool_format: from the chat
//     template) is parsed into message.tool_calls (finish_reason "tool_calls"; streamed as
//     tool_calls deltas once a call is complete). "required" and a named function are enforced
//     by a grammar of the call syntax with each function's parameter schema; "auto" leaves the
//     model free and parses what it wrote (a streamed reply is parsed when its first
//     non-blank character could open a call); "none" never parses. Templates without tool
//     support (the bundled ChatML model) get the Hermes format: the tools are described in a
//     system message (Qwen2.5's wording) and calls are `<tool_call>{json}</tool_call>`.
//     Messages may carry role "tool" (tool_call_id) and assistant tool_calls (arguments as a
//     JSON string, passed to templates as an object, as vLLM does).
//   * logit_bias: {"token id": bias in [-100, 100]}, at most 300; -100 bans the token outright.
//   * continuation_tokens (pdserve extension, completions; the router's failover re-issue): the
//     prompt's last N tokens were generated for this request already, so a grammar resumes after
//     them (they must follow it: else a 400) instead of starting over.
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

// The tool-call syntax of a chat template (pd_api_tool_format_detect).
typedef enum pd_api_tool_format {
    PD_API_TOOLS_FALLBACK = 0,  // no tool support in the template: Hermes syntax, tools described by us
    PD_API_TOOLS_HERMES = 1,    // <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen2.5)
    PD_API_TOOLS_MISTRAL = 2,   // [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    PD_API_TOOLS_LLAMA3 = 3,    // {"name": ..., "parameters": {...}} (Llama 3.1+ JSON tool calls)
} pd_api_tool_format;
pd_api_tool_format pd_api_tool_format_detect(const char *template_source);

typedef enum pd_api_tool_choice {
    PD_API_TOOL_CHOICE_AUTO = 0,
    PD_API_TOOL_CHOICE_NONE = 1,
    PD_API_TOOL_CHOICE_REQUIRED = 2,
    PD_API_TOOL_CHOICE_NAMED = 3,
} pd_api_tool_choice;

typedef enum pd_api_format {
    PD_API_FORMAT_TEXT = 0,
    PD_API_FORMAT_JSON_OBJECT = 1,
    PD_API_FORMAT_JSON_SCHEMA = 2,
    PD_API_FORMAT_GRAMMAR = 3,
} pd_api_format;

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
    pd_api_format format;      // response_format / grammar
    json_t *schema;            // JSON_SCHEMA: borrowed from root
    const char *grammar;       // GRAMMAR: borrowed from root
    json_t *tools;             // chat: validated "tools" array, borrowed; NULL = none
    pd_api_tool_choice tool_choice;
    const char *tool_name;     // NAMED: borrowed
    bool parallel_tool_calls;  // default true
    pd_api_tool_format tool_format;  // set by the caller before tokenize (default FALLBACK)
    pd_logit_bias *logit_bias; // owned (pd_malloc)
    int n_logit_bias;
    int continuation_tokens;   // completions: the prompt's last N tokens are this request's own output
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

// Turns r's prompt or messages into token ids (and checks logit_bias ids against the
// vocabulary): chat renders r->messages with tmpl
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
// The STATE message of GET /internal/state (wire/control.h) plus, on a decode worker, its
// "disagg_model" (wire/link.h): what the router polls or the NATS presence carries. New reference
// (NULL on OOM). Loop thread.
json_t *pd_api_state_json(pd_api *a, uint64_t since, int max_events);
int pd_api_n_engine_requests(const pd_api *a);

#ifdef __cplusplus
}
#endif
