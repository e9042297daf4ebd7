// chat — chat templates: OpenAI-style `messages` to prompt text, as transformers'
// tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...) does.
//
// A pd_chat_template is a parsed Jinja template (see jinja.h) plus the model's bos/eos token
// strings. Rendering builds the context transformers passes to the template:
//   messages, tools (null unless given), documents (null unless given), add_generation_prompt,
//   bos_token, eos_token, then every key of extra_kwargs (which may override any of these, e.g.
//   "tools", "date_string", "enable_thinking").
// Rendering never modifies messages or extra_kwargs. A template is immutable once made: apply it
// from any number of threads at once.
//
// Errors: a template that calls raise_exception(msg) (Mistral: "Conversation roles must
// alternate...") fails with PD_ERR_INVALID and err->msg == msg exactly, meant for the client
// (HTTP 400).
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "base/base.h"
#include "tok/jinja.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_chat_template pd_chat_template;

// Parses template source. bos_token/eos_token may be NULL (treated as ""); they are copied.
// Returns the template (free with pd_chat_template_free), or NULL with err set
// (PD_ERR_INVALID: syntax error with "line L:C: ..."; PD_ERR_NOMEM).
pd_chat_template *pd_chat_template_new(const char *src, size_t len, const char *bos_token,
                                       const char *eos_token, pd_err *err);

// Loads the chat template of a Hugging Face model folder, looking in this order at
// chat_template.jinja, chat_template.json {"chat_template": ...} and tokenizer_config.json
// "chat_template" (a string, or a list of {"name", "template"} from which "default" is taken).
// bos/eos come from tokenizer_config.json, else special_tokens_map.json (strings or
// {"content": ...}); missing ones are "".
//   NULL + PD_ERR_NOTFOUND  the folder has no chat template
//   NULL + PD_ERR_INVALID   a file is malformed or the template has a syntax error
//   NULL + PD_ERR_IO / PD_ERR_NOMEM
pd_chat_template *pd_chat_template_load(const char *model_dir, pd_err *err);

// Frees a template; NULL is a no-op.
void pd_chat_template_free(pd_chat_template *ct);

// The special token strings (never NULL), valid until pd_chat_template_free.
const char *pd_chat_template_bos(const pd_chat_template *ct);
const char *pd_chat_template_eos(const pd_chat_template *ct);
// The parsed template, valid until pd_chat_template_free.
const pd_jinja_tmpl *pd_chat_template_jinja(const pd_chat_template *ct);

// Renders messages (a JSON array, borrowed) to prompt text. extra_kwargs: a JSON object or NULL.
// limits: NULL = pd_jinja_limits_default(). out: owned by caller (pd_free); out_len may be NULL.
//   PD_OK
//   PD_ERR_INVALID  messages is not an array, extra_kwargs not an object, the template raised
//                   (err->msg is its message), a runtime template error, or a limit was exceeded
//   PD_ERR_NOMEM
pd_status pd_chat_template_apply(const pd_chat_template *ct, json_t *messages,
                                 bool add_generation_prompt, json_t *extra_kwargs,
                                 const pd_jinja_limits *limits, char **out, size_t *out_len,
                                 pd_err *err);

// One-shot convenience: parses template_src (NUL-terminated) and renders it once. Same results as
// pd_chat_template_apply; out is NUL-terminated and owned by the caller (pd_free).
pd_status pd_chat_apply(const char *template_src, json_t *messages, bool add_generation_prompt,
                        const char *bos_token, const char *eos_token, json_t *extra_kwargs,
                        char **out, pd_err *err);

// The "chat_template" of a parsed tokenizer_config.json (or chat_template.json) object: a string,
// or from a list of {"name", "template"} the entry called name (NULL = "default").
// *out is borrowed from config. PD_ERR_NOTFOUND if absent, PD_ERR_INVALID if malformed.
pd_status pd_chat_template_from_config(json_t *config, const char *name, const char **out,
                                       pd_err *err);

#ifdef __cplusplus
}
#endif
