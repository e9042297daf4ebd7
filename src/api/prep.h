// prep.h — request preparation off the event loop: a small pool of worker threads parses a body,
// renders the chat template and tokenizes (pd_api_request_parse + pd_api_request_tokenize), so a
// maximal prompt no longer stalls every stream on the HTTP event-loop thread.
//
//   loop thread                       worker thread(s)                  loop thread
//   pd_api_prep_submit(r, body) ──►  queue ──► parse, template,   ──►  eventfd ──► done(job):
//   (body copied, close cb set)                 tokenize                reply an error, or
//                                                                       submit to the engine
//
// Threads meet only in the pool's two lists (queue, finished) under one mutex; the finished list
// reaches the loop through an eventfd watched by the loop. Everything a worker reads besides its
// job is read-only after load (the tokenizer, the compiled chat template, the model name; jansson
// reference counts are atomic).
//
// Cancellation: a client that closes its connection while its request is queued or being prepared
// gets the job marked cancelled (the close callback, on the loop); a worker skips a cancelled job
// that has not started, and the loop frees a cancelled job when it comes back without calling
// done. So nothing a worker does ever touches a request that is gone.
//
// Ownership: the pool owns every job from submit until done returns (the job and its parsed
// request/prompts are freed right after done; done may move rq/pr out by zeroing them).
#pragma once

#include "api/api.h"
#include "http/http.h"

typedef struct pd_api_prep pd_api_prep;
typedef struct api_prep_job api_prep_job;

// Runs on the loop thread for a job whose client is still connected; pj->http is valid and has
// no close callback (set one if the request is kept).
typedef void (*api_prep_done_fn)(api_prep_job *pj, void *ud);

struct api_prep_job {
    pd_http_req *http;       // NULL once the client is gone
    bool detect_kind;        // kind from the body: "messages" means chat (/internal/tokenize)
    pd_api_kind kind;
    pd_status status;        // PD_OK: rq and pr are valid; else e says why
    pd_api_request rq;
    pd_api_prompts pr;
    pd_api_error e;
    // internal
    pd_api_prep *pool;
    api_prep_done_fn done;
    void *ud;
    char *body;              // owned copy
    size_t len;
    _Atomic bool is_cancelled;
    api_prep_job *next;
};

typedef struct pd_api_prep_params {
    const pd_tok *tok;             // borrowed, read-only
    const pd_chat_template *tmpl;  // borrowed, read-only; NULL: chat requests fail as before
    const char *model_name;        // borrowed
    int max_model_len;
    int n_threads;                 // 0 = online cores / 4; clamped to 2..4
    pd_api_tool_format tool_format;  // the chat template's tool-call syntax (api.h)
} pd_api_prep_params;

// NULL on failure (err says why). The pool watches its eventfd on base.
pd_api_prep *pd_api_prep_new(struct event_base *base, const pd_api_prep_params *p, pd_err *err);
// Stops and joins the workers and frees every job still held (done is not called; the close
// callbacks of their requests are cleared). NULL is a no-op.
void pd_api_prep_free(pd_api_prep *p);

// Queues r's body for preparation (the body is copied; r gets a close callback). PD_ERR_NOMEM:
// nothing queued, r untouched.
pd_status pd_api_prep_submit(pd_api_prep *p, pd_http_req *r, pd_api_kind kind, bool detect_kind,
                             api_prep_done_fn done, void *ud);

int pd_api_prep_n_pending(const pd_api_prep *p);    // submitted, not yet returned to the loop
int pd_api_prep_n_threads(const pd_api_prep *p);
long pd_api_prep_n_cancelled(const pd_api_prep *p); // jobs whose client went away while pending

// Test hook: when set, every worker calls fn(body, len) before preparing a job (tests block in it
// to hold a request "in tokenization"). Process-wide; NULL removes it.
void pd_api_prep_set_test_hook(void (*fn)(const char *body, size_t len));
