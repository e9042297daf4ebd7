// jinja — the subset of Jinja2 that Hugging Face chat templates use, in C.
//
// A chat completion request turns `messages` into a prompt with the Jinja template a model ships in
// tokenizer_config.json. transformers renders it with jinja2's ImmutableSandboxedEnvironment
// (trim_blocks, lstrip_blocks, loopcontrols), a `tojson` filter that is json.dumps with
// ensure_ascii=False, and the globals raise_exception(msg) and strftime_now(fmt). This module
// reproduces that environment byte for byte for the templates real models ship (Llama 2/3/3.1,
// Mistral, Qwen2/2.5, ChatML ...); tests/data/chat holds outputs that real jinja2 produced.
//
// Data is jansson json_t: the render context is a JSON object (its keys become variables), and
// values keep Python semantics (str/repr of lists and dicts, float repr, int/float arithmetic,
// codepoint-based string length and slicing, insertion-ordered dicts).
//
// Supported: {{ }}, {% %}, {# #}, whitespace control (-, +), trim_blocks/lstrip_blocks exactly as
// jinja2's lexer applies them, raw; statements for (tuple targets, `if` filter, else, loop.*,
// loop.cycle), if/elif/else, set (incl. namespace attributes and block set), macro + call, break,
// continue, filter blocks, with, print, block, generation; expressions with literals, attribute and
// item access, slicing, arithmetic, ~, comparisons, and/or/not, in, is-tests, ternaries, calls and
// filters. See jinja_filter.c for the list of filters, tests and str/dict methods.
//
// Deliberately not handled: template inheritance/include/import (there is no loader), {% call %}
// blocks, recursive loops, autoescape, the lipsum/cycler/joiner globals, complex numbers, integers
// beyond int64 (an overflow is a render error). Tuples are lists, so a printed tuple shows as
// [1, 2] where Python shows (1, 2). Case mapping covers ASCII, Latin-1, Latin Extended-A, Greek,
// Cyrillic and fullwidth Latin (plus "ß" -> "SS"), not Python's contextual rules (final sigma).
//
// Undefined variables render as "" and are falsy (jinja2's default Undefined); any other use of
// one (attribute access, arithmetic, calling) is a render error, as in jinja2.
//
// Safety: rendering is bounded by pd_jinja_limits (output bytes, evaluation steps, list sizes,
// macro depth; values nested deeper than 256 levels are an error when printed), so a hostile
// template or a huge request fails with an error instead of hanging or exhausting memory.
// Building strings and lists costs steps too, so max_steps also bounds the memory a render churns.
// A parsed template is immutable and renders never touch it (not even reference counts): render
// it from many threads at once. A context may be shared as well (it is only read; jansson's
// reference counts are atomic), though per-request contexts are the usual case.
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_jinja_tmpl pd_jinja_tmpl;

// Bounds on one render. Exceeding one fails the render with PD_ERR_INVALID and a message.
typedef struct pd_jinja_limits {
    size_t max_output_bytes;  // output, and any single string the template builds
    uint64_t max_steps;       // expression/statement evaluations (bounds time)
    size_t max_items;         // any list the template builds (range(), list * n, ...)
    int max_depth;            // macro call depth
    int64_t now_unix;         // clock for strftime_now (formatted in UTC); 0 = time() in local time
} pd_jinja_limits;

// Defaults: 16 MiB output, 20M steps, 1M items, depth 64, real clock.
pd_jinja_limits pd_jinja_limits_default(void);

// Parses a template. src need not be NUL-terminated; it must be valid UTF-8.
// Returns the template (free with pd_jinja_free), or NULL with err set:
//   PD_ERR_INVALID  syntax error; err->msg starts with "line L:C: "
//   PD_ERR_NOMEM    allocation failure
pd_jinja_tmpl *pd_jinja_parse(const char *src, size_t len, pd_err *err);

// Frees a template; NULL is a no-op.
void pd_jinja_free(pd_jinja_tmpl *t);

// Renders t with the variables of context (a JSON object, borrowed; NULL = no variables) under the
// default limits. out: owned by caller (pd_free), NUL-terminated, valid UTF-8; out_len may be NULL.
//   PD_OK           rendered
//   PD_ERR_INVALID  the template raised (raise_exception: err->msg is exactly its message), hit a
//                   runtime error (err->msg starts with "line L: "), or exceeded a limit
//   PD_ERR_NOMEM    allocation failure
// Thread-safe: any number of renders of one template may run at once (the context is only read).
pd_status pd_jinja_render(const pd_jinja_tmpl *t, json_t *context, char **out, size_t *out_len,
                          pd_err *err);

// pd_jinja_render with explicit limits (NULL = defaults).
pd_status pd_jinja_render_ex(const pd_jinja_tmpl *t, json_t *context, const pd_jinja_limits *limits,
                             char **out, size_t *out_len, pd_err *err);

#ifdef __cplusplus
}
#endif
