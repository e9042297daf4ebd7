// request.c — parsing and validating OpenAI request bodies (pd_api_request_parse), turning them
// into token ids (pd_api_request_tokenize), and the one pd_status → HTTP mapping.
//
// Parsing is a table of typed getters: each looks a field up, treats absent and JSON null alike
// ("not given"), and on a wrong type or range fills pd_api_error with the field's name. Nothing
// here touches the engine, so every bad-input case is unit-tested without a model.
#include <ctype.h>
#include <limits.h>
#include <stdlib.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "api/api_impl.h"

int pd_api_status_http(pd_status s, const char **type) {
    int http;
    const char *t;
    switch (s) {
    case PD_OK: http = 200; t = ""; break;
    case PD_ERR_INVALID:
    case PD_ERR_PROTO:
    case PD_ERR_UNSUPPORTED: http = 400; t = "invalid_request_error"; break;
    case PD_ERR_NOTFOUND: http = 404; t = "invalid_request_error"; break;
    case PD_NOSPACE:
    case PD_AGAIN: http = 503; t = "server_error"; break;
    case PD_ERR_TIMEOUT: http = 504; t = "server_error"; break;
    default: http = 500; t = "server_error"; break;
    }
    if (type) *type = t;
    return http;
}

static pd_status fail(pd_api_error *e, pd_status st, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static pd_status fail(pd_api_error *e, pd_status st, const char *param, const char *fmt, ...) {
    if (!e) return st;
    e->status = st;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    e->code = NULL;
    return st;
}

// ---- typed getters: PD_OK (value set or absent: *given false), or PD_ERR_INVALID -------------

static json_t *field(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

static pd_status get_bool(json_t *o, const char *key, bool *out, pd_api_error *e) {
    json_t *v = field(o, key);
    if (!v) return PD_OK;
    if (!json_is_boolean(v)) return fail(e, PD_ERR_INVALID, key, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return PD_OK;
}

// Integers: JSON integers, or reals with an integral value (pydantic's lax mode accepts 5.0).
static pd_status get_int(json_t *o, const char *key, long long lo, long long hi, long long *out,
                         bool *given, pd_api_error *e) {
    json_t *v = field(o, key);
    if (given) *given = v != NULL;
    if (!v) return PD_OK;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
               fabs(json_real_value(v)) < 9e18) {
        x = (long long)json_real_value(v);
    } else {
        return fail(e, PD_ERR_INVALID, key, "'%s' must be an integer", key);
    }
    if (x < lo || x > hi) {
        if (hi == LLONG_MAX) return fail(e, PD_ERR_INVALID, key, "'%s' must be >= %lld, got %lld", key, lo, x);
        return fail(e, PD_ERR_INVALID, key, "'%s' must be between %lld and %lld, got %lld", key, lo, hi, x);
    }
    *out = x;
    return PD_OK;
}

// Numbers: JSON integer or real, finite, in [lo, hi] (lo_open excludes lo).
static pd_status get_num(json_t *o, const char *key, double lo, bool lo_open, double hi, float *out,
                         pd_api_error *e) {
    json_t *v = field(o, key);
    if (!v) return PD_OK;
    if (!json_is_number(v)) return fail(e, PD_ERR_INVALID, key, "'%s' must be a number", key);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
        return fail(e, PD_ERR_INVALID, key, "'%s' must be %s %g and <= %g, got %g", key,
                    lo_open ? ">" : ">=", lo, hi, x);
    *out = (float)x;
    return PD_OK;
}

// ---- the field tables (api.h: every field is known or refused) -----------------------------------

static const char *const k_fields_common[] = {
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format", "grammar",
    // accepted, no effect on the output here
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "modalities",
    // vLLM extensions
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "return_token_ids", "priority", "add_special_tokens",
    // pdserve extensions
    "timings", NULL};
static const char *const k_fields_chat[] = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                            "parallel_tool_calls", "chat_template_kwargs", NULL};
static const char *const k_fields_completion[] = {"prompt", "best_of", "echo", "suffix", "continuation_tokens", NULL};
// OpenAI fields that would change the output and are not implemented.
static const char *const k_fields_unsupported[] = {"audio", "prediction", "reasoning_effort", "web_search_options",
                                                   "verbosity", "functions", "function_call", NULL};

static bool in_table(const char *const *t, const char *k) {
    for (; *t; t++)
        if (!strcmp(*t, k)) return true;
    return false;
}

static pd_status check_fields(pd_api_request *r, pd_api_error *e) {
    const char *k;
    json_t *v;
    json_object_foreach(r->root, k, v) {
        if (in_table(k_fields_common, k) || in_table(r->kind == PD_API_CHAT ? k_fields_chat : k_fields_completion, k))
            continue;
        if (in_table(k_fields_unsupported, k)) {
            if (json_is_null(v)) continue;
            if (!strcmp(k, "functions") || !strcmp(k, "function_call"))
                return fail(e, PD_ERR_INVALID, k, "'%s' is deprecated and not supported: use 'tools' and 'tool_choice'", k);
            return fail(e, PD_ERR_INVALID, k, "'%s' is not supported by this server", k);
        }
        return fail(e, PD_ERR_INVALID, k, "Unrecognized request argument supplied: %.100s", k);
    }
    json_t *mod = field(r->root, "modalities");
    if (mod && !(json_is_array(mod) && json_array_size(mod) == 1 && json_is_string(json_array_get(mod, 0)) &&
                 !strcmp(json_string_value(json_array_get(mod, 0)), "text")))
        return fail(e, PD_ERR_INVALID, "modalities", "only 'modalities': [\"text\"] is supported");
    json_t *md = field(r->root, "metadata");
    if (md && !json_is_object(md)) return fail(e, PD_ERR_INVALID, "metadata", "'metadata' must be an object");
    json_t *user = field(r->root, "user");
    if (user && !json_is_string(user)) return fail(e, PD_ERR_INVALID, "user", "'user' must be a string");
    return PD_OK;
}

// ---- pieces ------------------------------------------------------------------------------------

static pd_status parse_stop(pd_api_request *r, pd_api_error *e) {
    json_t *v = field(r->root, "stop");
    if (!v) return PD_OK;
    if (json_is_string(v)) {
        if (!json_string_length(v)) return fail(e, PD_ERR_INVALID, "stop", "'stop' strings must not be empty");
        r->stops[r->n_stops++] = json_string_value(v);
        return PD_OK;
    }
    if (!json_is_array(v)) return fail(e, PD_ERR_INVALID, "stop", "'stop' must be a string or an array of strings");
    if (json_array_size(v) > PD_API_MAX_STOPS)
        return fail(e, PD_ERR_INVALID, "stop", "'stop' may hold at most %d strings", PD_API_MAX_STOPS);
    size_t i;
    json_t *s;
    json_array_foreach(v, i, s) {
        if (!json_is_string(s)) return fail(e, PD_ERR_INVALID, "stop", "'stop' must be a string or an array of strings");
        if (!json_string_length(s)) return fail(e, PD_ERR_INVALID, "stop", "'stop' strings must not be empty");
        if (strlen(json_string_value(s)) != json_string_length(s))
            return fail(e, PD_ERR_INVALID, "stop", "'stop' strings must not contain NUL");
        r->stops[r->n_stops++] = json_string_value(s);
    }
    return PD_OK;
}

static pd_status parse_stop_ids(pd_api_request *r, pd_api_error *e) {
    json_t *v = field(r->root, "stop_token_ids");
    if (!v) return PD_OK;
    if (!json_is_array(v) || json_array_size(v) > PD_API_MAX_STOP_IDS)
        return fail(e, PD_ERR_INVALID, "stop_token_ids", "'stop_token_ids' must be an array of at most %d token ids",
                    PD_API_MAX_STOP_IDS);
    size_t i;
    json_t *s;
    json_array_foreach(v, i, s) {
        if (!json_is_integer(s) || json_integer_value(s) < 0 || json_integer_value(s) > INT32_MAX)
            return fail(e, PD_ERR_INVALID, "stop_token_ids", "'stop_token_ids' must hold non-negative integers");
        r->stop_ids[r->n_stop_ids++] = (int32_t)json_integer_value(s);
    }
    return PD_OK;
}

static pd_status parse_sampling(pd_api_request *r, pd_api_error *e) {
    json_t *o = r->root;
    pd_sampling_params *sp = &r->sampling;
    long long v;
    bool given;
    pd_status st;
    if ((st = get_num(o, "temperature", 0, false, 100, &sp->temperature, e))) return st;
    if ((st = get_num(o, "top_p", 0, true, 1, &sp->top_p, e))) return st;
    if ((st = get_num(o, "min_p", 0, false, 1, &sp->min_p, e))) return st;
    if ((st = get_num(o, "presence_penalty", -2, false, 2, &sp->presence_penalty, e))) return st;
    if ((st = get_num(o, "frequency_penalty", -2, false, 2, &sp->frequency_penalty, e))) return st;
    if ((st = get_num(o, "repetition_penalty", 0, true, 10, &sp->repetition_penalty, e))) return st;
    if ((st = get_int(o, "top_k", -1, INT_MAX, &v, &given, e))) return st;
    if (given) sp->top_k = (int)v;
    if ((st = get_int(o, "seed", LLONG_MIN, LLONG_MAX, &v, &given, e))) return st;
    if (given) {
        sp->seed = (uint64_t)v;
        sp->has_seed = true;
    }
    return PD_OK;
}

static pd_status parse_logprobs(pd_api_request *r, pd_api_error *e) {
    long long v;
    bool given;
    pd_status st;
    r->logprobs = -1;
    if (r->kind == PD_API_COMPLETION) {
        json_t *lp = field(r->root, "logprobs");
        if (lp && json_is_boolean(lp))  // OpenAI's completions take an integer here
            return fail(e, PD_ERR_INVALID, "logprobs", "'logprobs' must be an integer");
        if ((st = get_int(r->root, "logprobs", 0, PD_MAX_LOGPROBS, &v, &given, e))) return st;
        if (given) r->logprobs = (int)v;
        return PD_OK;
    }
    bool want = false;
    if ((st = get_bool(r->root, "logprobs", &want, e))) return st;
    if ((st = get_int(r->root, "top_logprobs", 0, PD_MAX_LOGPROBS, &v, &given, e))) return st;
    if (given && !want)
        return fail(e, PD_ERR_INVALID, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
    if (want) r->logprobs = given ? (int)v : 0;
    return PD_OK;
}

static pd_status parse_format(pd_api_request *r, pd_api_error *e) {
    json_t *rf = field(r->root, "response_format"), *g = field(r->root, "grammar");
    if (g) {
        if (!json_is_string(g) || !json_string_length(g))
            return fail(e, PD_ERR_INVALID, "grammar", "'grammar' must be a non-empty GBNF string");
        r->format = PD_API_FORMAT_GRAMMAR;
        r->grammar = json_string_value(g);
    }
    if (!rf) return PD_OK;
    json_t *ty = json_object_get(rf, "type");
    if (!json_is_object(rf) || !json_is_string(ty))
        return fail(e, PD_ERR_INVALID, "response_format", "'response_format' must be an object with a 'type'");
    const char *t = json_string_value(ty);
    if (!strcmp(t, "text")) return PD_OK;
    if (g) return fail(e, PD_ERR_INVALID, "grammar", "'grammar' and a 'response_format' other than text are exclusive");
    if (!strcmp(t, "json_object")) {
        r->format = PD_API_FORMAT_JSON_OBJECT;
        return PD_OK;
    }
    if (strcmp(t, "json_schema"))
        return fail(e, PD_ERR_INVALID, "response_format",
                    "'response_format.type' must be 'text', 'json_object' or 'json_schema', got '%.40s'", t);
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return fail(e, PD_ERR_INVALID, "response_format", "'response_format.json_schema' must be an object");
    json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    if (name && !json_is_string(name))
        return fail(e, PD_ERR_INVALID, "response_format", "'response_format.json_schema.name' must be a string");
    if (strict && !json_is_boolean(strict) && !json_is_null(strict))
        return fail(e, PD_ERR_INVALID, "response_format", "'response_format.json_schema.strict' must be a boolean");
    json_t *schema = json_object_get(js, "schema");
    if (!schema || json_is_null(schema)) schema = json_object_get(rf, "schema");  // some clients nest it here
    if (!json_is_object(schema) && !json_is_true(schema))
        return fail(e, PD_ERR_INVALID, "response_format", "'response_format.json_schema.schema' must be an object");
    r->format = PD_API_FORMAT_JSON_SCHEMA;
    r->schema = schema;
    return PD_OK;
}

static pd_status parse_logit_bias(pd_api_request *r, pd_api_error *e) {
    json_t *lb = field(r->root, "logit_bias");
    if (!lb) return PD_OK;
    if (!json_is_object(lb)) return fail(e, PD_ERR_INVALID, "logit_bias", "'logit_bias' must be an object");
    if (json_object_size(lb) > 300)
        return fail(e, PD_ERR_INVALID, "logit_bias", "'logit_bias' may hold at most 300 tokens");
    if (!json_object_size(lb)) return PD_OK;
    r->logit_bias = pd_malloc(sizeof(pd_logit_bias) * json_object_size(lb));
    if (!r->logit_bias) return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    const char *k;
    json_t *v;
    json_object_foreach(lb, k, v) {
        char *end = NULL;
        long id = strtol(k, &end, 10);
        if (!*k || *end || id < 0 || id > INT32_MAX)
            return fail(e, PD_ERR_INVALID, "logit_bias", "'logit_bias' keys must be token ids, got '%.40s'", k);
        if (!json_is_number(v) || !(json_number_value(v) >= -100 && json_number_value(v) <= 100))
            return fail(e, PD_ERR_INVALID, "logit_bias", "'logit_bias' values must be numbers between -100 and 100");
        for (int i = 0; i < r->n_logit_bias; i++)
            if (r->logit_bias[i].token == (int32_t)id)
                return fail(e, PD_ERR_INVALID, "logit_bias", "'logit_bias' names token %ld twice", id);
        r->logit_bias[r->n_logit_bias++] = (pd_logit_bias){(int32_t)id, (float)json_number_value(v)};
    }
    return PD_OK;
}

static bool valid_fn_name(const char *s) {
    size_t n = strlen(s);
    if (!n || n > 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == '-')) return false;
    return true;
}

static pd_status parse_tools(pd_api_request *r, pd_api_error *e) {
    json_t *tools = field(r->root, "tools"), *tc = field(r->root, "tool_choice");
    r->parallel_tool_calls = true;
    pd_status st = get_bool(r->root, "parallel_tool_calls", &r->parallel_tool_calls, e);
    if (st) return st;
    if (tools) {
        if (!json_is_array(tools)) return fail(e, PD_ERR_INVALID, "tools", "'tools' must be an array");
        if (json_array_size(tools) > 128) return fail(e, PD_ERR_INVALID, "tools", "at most 128 tools");
        size_t i, j;
        json_t *t, *u;
        json_array_foreach(tools, i, t) {
            json_t *ty = json_object_get(t, "type"), *fn = json_object_get(t, "function");
            if (!json_is_object(t) || !json_is_string(ty) || strcmp(json_string_value(ty), "function"))
                return fail(e, PD_ERR_INVALID, "tools", "tools[%zu]: only tools of type 'function' are supported", i);
            json_t *name = json_object_get(fn, "name"), *params = json_object_get(fn, "parameters");
            if (!json_is_object(fn) || !json_is_string(name) || !valid_fn_name(json_string_value(name)))
                return fail(e, PD_ERR_INVALID, "tools",
                            "tools[%zu].function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", i);
            if (params && !json_is_null(params) && !json_is_object(params))
                return fail(e, PD_ERR_INVALID, "tools", "tools[%zu].function.parameters must be an object", i);
            json_array_foreach(tools, j, u) {
                if (j >= i) break;
                if (!strcmp(json_string_value(json_object_get(json_object_get(u, "function"), "name")),
                            json_string_value(name)))
                    return fail(e, PD_ERR_INVALID, "tools", "two tools are named '%s'", json_string_value(name));
            }
        }
        if (json_array_size(tools)) r->tools = tools;
    }
    r->tool_choice = r->tools ? PD_API_TOOL_CHOICE_AUTO : PD_API_TOOL_CHOICE_NONE;
    if (!tc) return PD_OK;
    if (json_is_string(tc)) {
        const char *c = json_string_value(tc);
        if (!strcmp(c, "none")) r->tool_choice = PD_API_TOOL_CHOICE_NONE;
        else if (!strcmp(c, "auto")) r->tool_choice = r->tools ? PD_API_TOOL_CHOICE_AUTO : PD_API_TOOL_CHOICE_NONE;
        else if (!strcmp(c, "required")) r->tool_choice = PD_API_TOOL_CHOICE_REQUIRED;
        else return fail(e, PD_ERR_INVALID, "tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a function");
    } else {
        json_t *fn = json_object_get(tc, "function"), *name = json_object_get(fn, "name");
        if (!json_is_object(tc) || !json_is_string(name))
            return fail(e, PD_ERR_INVALID, "tool_choice",
                        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\":\"function\",\"function\":{\"name\":...}}");
        r->tool_choice = PD_API_TOOL_CHOICE_NAMED;
        r->tool_name = json_string_value(name);
    }
    if (r->tool_choice >= PD_API_TOOL_CHOICE_REQUIRED && !r->tools)
        return fail(e, PD_ERR_INVALID, "tool_choice", "'tool_choice' requires 'tools'");
    if (r->tool_choice == PD_API_TOOL_CHOICE_NAMED) {
        size_t i;
        json_t *t;
        bool found = false;
        json_array_foreach(r->tools, i, t) found |= !strcmp(
            json_string_value(json_object_get(json_object_get(t, "function"), "name")), r->tool_name);
        if (!found) return fail(e, PD_ERR_INVALID, "tool_choice", "tool_choice names '%.64s', which is not in 'tools'", r->tool_name);
    }
    if (r->tool_choice >= PD_API_TOOL_CHOICE_REQUIRED && r->format != PD_API_FORMAT_TEXT)
        return fail(e, PD_ERR_INVALID, "tool_choice",
                    "a required or named 'tool_choice' cannot be combined with 'response_format' or 'grammar'");
    return PD_OK;
}

// An assistant message's tool_calls, checked and with each function.arguments (a JSON string
// from OpenAI clients) also available as an object for templates (vLLM does the same).
static pd_status normalise_tool_calls(json_t *copy, size_t i, pd_api_error *e) {
    json_t *calls = json_object_get(copy, "tool_calls");
    if (!calls || json_is_null(calls)) return PD_OK;
    if (!json_is_array(calls)) return fail(e, PD_ERR_INVALID, "messages", "messages[%zu].tool_calls must be an array", i);
    size_t k;
    json_t *c;
    json_array_foreach(calls, k, c) {
        json_t *fn = json_object_get(c, "function");
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_object(c) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return fail(e, PD_ERR_INVALID, "messages", "messages[%zu].tool_calls[%zu] needs function.name", i, k);
        if (json_is_string(args)) {
            json_t *obj = json_loads(json_string_value(args), JSON_DECODE_ANY, NULL);
            if (!obj)
                return fail(e, PD_ERR_INVALID, "messages", "messages[%zu].tool_calls[%zu].function.arguments is not JSON", i, k);
            json_object_set_new(fn, "arguments", obj);
        } else if (!args || json_is_null(args)) {
            json_object_set_new(fn, "arguments", json_object());
        }
    }
    return PD_OK;
}

// Appends the text of one content value: a string, or an array of {"type":"text","text":...}.
static pd_status content_text(json_t *c, json_t **out, pd_api_error *e) {
    if (!c || json_is_null(c)) {
        *out = json_string("");
        return *out ? PD_OK : fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    }
    if (json_is_string(c)) {
        *out = json_incref(c);
        return PD_OK;
    }
    if (!json_is_array(c))
        return fail(e, PD_ERR_INVALID, "messages", "message 'content' must be a string or an array of parts");
    size_t total = 0, i;
    json_t *part;
    json_array_foreach(c, i, part) {
        json_t *ty = json_object_get(part, "type"), *tx = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") ||
            !json_is_string(tx))
            return fail(e, PD_ERR_INVALID, "messages", "only content parts of type 'text' are supported");
        total += json_string_length(tx) + 1;
    }
    char *buf = pd_malloc(total + 1);
    if (!buf) return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    size_t len = 0;
    json_array_foreach(c, i, part) {
        json_t *tx = json_object_get(part, "text");
        if (i) buf[len++] = '\n';
        memcpy(buf + len, json_string_value(tx), json_string_length(tx));
        len += json_string_length(tx);
    }
    *out = json_stringn(buf, len);
    pd_free(buf);
    return *out ? PD_OK : fail(e, PD_ERR_NOMEM, NULL, "out of memory");
}

// Builds r->messages: a copy of each message with content normalised to a string.
static pd_status parse_messages(pd_api_request *r, pd_api_error *e) {
    json_t *m = json_object_get(r->root, "messages");
    if (!m) return fail(e, PD_ERR_INVALID, "messages", "'messages' is required");
    if (!json_is_array(m) || !json_array_size(m))
        return fail(e, PD_ERR_INVALID, "messages", "'messages' must be a non-empty array");
    r->messages = json_array();
    if (!r->messages) return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    size_t i;
    json_t *msg;
    json_array_foreach(m, i, msg) {
        if (!json_is_object(msg)) return fail(e, PD_ERR_INVALID, "messages", "messages[%zu] must be an object", i);
        json_t *role = json_object_get(msg, "role");
        if (!json_is_string(role) || !json_string_length(role))
            return fail(e, PD_ERR_INVALID, "messages", "messages[%zu].role must be a non-empty string", i);
        json_t *text = NULL;
        pd_status st = content_text(json_object_get(msg, "content"), &text, e);
        if (st) {
            if (st == PD_ERR_INVALID)
                snprintf(e->message + strlen(e->message), sizeof e->message - strlen(e->message),
                         " (messages[%zu])", i);
            return st;
        }
        json_t *copy = json_deep_copy(msg);
        if (!copy || json_object_set_new(copy, "content", text) || json_array_append_new(r->messages, copy)) {
            if (!copy) json_decref(text);
            return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
        }
        if ((st = normalise_tool_calls(copy, i, e))) return st;
        const char *rs = json_string_value(role);
        json_t *tcid = json_object_get(msg, "tool_call_id");
        if (!strcmp(rs, "tool") && tcid && !json_is_string(tcid))
            return fail(e, PD_ERR_INVALID, "messages", "messages[%zu].tool_call_id must be a string", i);
    }
    return PD_OK;
}

// Checks the shape of a completions prompt (tokenize does the rest).
static pd_status check_prompt(pd_api_request *r, pd_api_error *e) {
    json_t *p = json_object_get(r->root, "prompt");
    if (!p || json_is_null(p)) return fail(e, PD_ERR_INVALID, "prompt", "'prompt' is required");
    r->prompt = p;
    if (json_is_string(p)) return PD_OK;
    if (!json_is_array(p) || !json_array_size(p))
        return fail(e, PD_ERR_INVALID, "prompt",
                    "'prompt' must be a string, a non-empty array of token ids, strings, or token-id arrays");
    json_t *first = json_array_get(p, 0);
    size_t i;
    json_t *x;
    json_array_foreach(p, i, x) {
        bool ok = json_is_integer(first)  ? json_is_integer(x)
                  : json_is_string(first) ? json_is_string(x)
                  : json_is_array(first)  ? json_is_array(x) && json_array_size(x) > 0
                                          : false;
        if (!ok) return fail(e, PD_ERR_INVALID, "prompt", "'prompt' array items must all be token ids, strings, or non-empty token-id arrays");
        if (json_is_array(x)) {
            size_t j;
            json_t *t;
            json_array_foreach(x, j, t) if (!json_is_integer(t))
                return fail(e, PD_ERR_INVALID, "prompt", "'prompt' token-id arrays must hold integers");
        }
    }
    return PD_OK;
}

static size_t n_prompts(const pd_api_request *r) {
    if (r->kind == PD_API_CHAT || json_is_string(r->prompt) || json_is_integer(json_array_get(r->prompt, 0)))
        return 1;
    return json_array_size(r->prompt);
}

static pd_status parse_fields(pd_api_request *r, const char *served, pd_api_error *e) {
    json_t *o = r->root;
    pd_status st;
    long long v;
    bool given;
    json_t *model = field(o, "model");
    if (model && !json_is_string(model)) return fail(e, PD_ERR_INVALID, "model", "'model' must be a string");
    if (model) {
        r->model = json_string_value(model);
        if (served && strcmp(r->model, served)) {
            fail(e, PD_ERR_NOTFOUND, "model", "The model `%.200s` does not exist.", r->model);
            e->code = "model_not_found";
            return PD_ERR_NOTFOUND;
        }
    }
    if ((st = check_fields(r, e))) return st;
    if (r->kind == PD_API_CHAT) {
        if ((st = parse_messages(r, e))) return st;
    } else if ((st = check_prompt(r, e))) {
        return st;
    }
    const char *mt = "max_tokens";
    if (r->kind == PD_API_CHAT && field(o, "max_completion_tokens")) mt = "max_completion_tokens";
    if ((st = get_int(o, mt, 1, INT_MAX, &v, &given, e))) return st;
    r->max_tokens = given ? (int)v : -1;
    if ((st = get_int(o, "n", 1, PD_API_MAX_N, &v, &given, e))) return st;
    if (given) r->n = (int)v;
    if (n_prompts(r) > 64) return fail(e, PD_ERR_INVALID, "prompt", "at most 64 prompts per request");
    if (n_prompts(r) * (size_t)r->n > 128)
        return fail(e, PD_ERR_INVALID, "n", "at most 128 choices per request (prompts x n)");
    json_t *bo = field(o, "best_of");
    if (bo && (!json_is_integer(bo) || (json_integer_value(bo) != 1 && json_integer_value(bo) != r->n)))
        return fail(e, PD_ERR_INVALID, "best_of", "'best_of' is not supported (must equal n)");
    if ((st = get_bool(o, "stream", &r->stream, e))) return st;
    json_t *so = field(o, "stream_options");
    if (so) {
        if (!json_is_object(so)) return fail(e, PD_ERR_INVALID, "stream_options", "'stream_options' must be an object");
        if (!r->stream)
            return fail(e, PD_ERR_INVALID, "stream_options", "'stream_options' is only allowed when 'stream' is true");
        if ((st = get_bool(so, "include_usage", &r->include_usage, e)) ||
            (st = get_bool(so, "include_timings", &r->include_timings, e))) {
            snprintf(e->param, sizeof e->param, "stream_options");
            return st;
        }
    }
    bool echo = false;
    if ((st = get_bool(o, "echo", &echo, e))) return st;
    if (echo) return fail(e, PD_ERR_INVALID, "echo", "'echo' is not supported");
    json_t *suffix = field(o, "suffix");
    if (suffix && (!json_is_string(suffix) || json_string_length(suffix)))
        return fail(e, PD_ERR_INVALID, "suffix", "'suffix' is not supported");
    if ((st = get_bool(o, "ignore_eos", &r->ignore_eos, e))) return st;
    if ((st = parse_format(r, e))) return st;
    if ((st = parse_logit_bias(r, e))) return st;
    if (r->kind == PD_API_CHAT && (st = parse_tools(r, e))) return st;
    bool constrained = r->format != PD_API_FORMAT_TEXT || r->tool_choice >= PD_API_TOOL_CHOICE_REQUIRED;
    if (constrained && r->ignore_eos)
        return fail(e, PD_ERR_INVALID, "ignore_eos", "'ignore_eos' cannot be combined with constrained decoding "
                                                     "(the grammar decides where the text may end)");
    if ((st = get_bool(o, "skip_special_tokens", &r->skip_special_tokens, e))) return st;
    if ((st = get_bool(o, "include_stop_str_in_output", &r->include_stop_str_in_output, e))) return st;
    if ((st = get_bool(o, "return_token_ids", &r->return_token_ids, e))) return st;
    if ((st = get_int(o, "continuation_tokens", 0, INT_MAX, &v, &given, e))) return st;
    if (given) r->continuation_tokens = (int)v;
    bool timings = false;  // pdserve extension: usage.ttft_breakdown (docs/router.md)
    if ((st = get_bool(o, "timings", &timings, e))) return st;
    if (timings) r->include_timings = true;
    if ((st = get_int(o, "priority", INT_MIN, INT_MAX, &v, &given, e))) return st;
    if (given) r->priority = (int)v;
    if ((st = parse_sampling(r, e))) return st;
    if ((st = parse_logprobs(r, e))) return st;
    if ((st = parse_stop(r, e))) return st;
    if ((st = parse_stop_ids(r, e))) return st;
    r->sampling.n_logprobs = r->logprobs;
    pd_err perr = {0};
    if (pd_sampling_params_validate(&r->sampling, &perr))  // backstop: every field is checked above
        return fail(e, PD_ERR_INVALID, NULL, "%s", perr.msg);
    return PD_OK;
}

pd_status pd_api_request_parse(pd_api_kind kind, const char *body, size_t len,
                               const char *served_model, pd_api_request *out, pd_api_error *err) {
    memset(out, 0, sizeof *out);
    if (err) memset(err, 0, sizeof *err);
    pd_api_request r = {0};
    r.kind = kind;
    r.n = 1;
    r.max_tokens = -1;
    r.logprobs = -1;
    r.skip_special_tokens = true;
    r.sampling = pd_sampling_params_default();
    json_error_t je;
    r.root = json_loadb(body, len, 0, &je);
    if (!r.root)
        return fail(err, PD_ERR_INVALID, NULL, "invalid JSON body: %s (line %d, column %d)", je.text, je.line,
                    je.column);
    if (!json_is_object(r.root)) {
        json_decref(r.root);
        return fail(err, PD_ERR_INVALID, NULL, "the request body must be a JSON object");
    }
    pd_api_error tmp;
    pd_status st = parse_fields(&r, served_model, err ? err : &tmp);
    if (st) {
        pd_api_request_fini(&r);
        return st;
    }
    *out = r;
    return PD_OK;
}

void pd_api_request_fini(pd_api_request *r) {
    if (!r) return;
    pd_free(r->logit_bias);
    json_decref(r->messages);
    json_decref(r->root);
    memset(r, 0, sizeof *r);
}

// ---- tokenize ----------------------------------------------------------------------------------

void pd_api_prompts_fini(pd_api_prompts *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) pd_tok_ids_free(&p->items[i]);
    pd_free(p->items);
    pd_free(p->max_tokens);
    memset(p, 0, sizeof *p);
}

static pd_status encode_text(const pd_tok *tok, const char *s, size_t n, bool add_special, pd_tok_ids *out,
                             const char *param, pd_api_error *e) {
    pd_status st = pd_tok_encode(tok, s, n, add_special, true, out);
    if (st == PD_ERR_INVALID) return fail(e, st, param, "'%s' is not valid UTF-8", param);
    if (st) return fail(e, st, NULL, "out of memory");
    return PD_OK;
}

static pd_status ids_from_json(const pd_tok *tok, json_t *arr, pd_tok_ids *out, pd_api_error *e) {
    int n_vocab = pd_tok_n_vocab(tok);
    size_t i;
    json_t *t;
    json_array_foreach(arr, i, t) {
        json_int_t id = json_integer_value(t);
        if (id < 0 || id >= n_vocab)
            return fail(e, PD_ERR_INVALID, "prompt", "token id %lld is out of range [0, %d)", (long long)id, n_vocab);
        if (pd_tok_ids_push(out, (int32_t)id)) return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    }
    return PD_OK;
}

// Extra template variables: "tools" (array) and vLLM's "chat_template_kwargs" (object).
static pd_status chat_extra(const pd_api_request *r, json_t **out, pd_api_error *e) {
    *out = NULL;
    json_t *tools = field(r->root, "tools"), *kw = field(r->root, "chat_template_kwargs");
    if (tools && !json_is_array(tools)) return fail(e, PD_ERR_INVALID, "tools", "'tools' must be an array");
    if (kw && !json_is_object(kw))
        return fail(e, PD_ERR_INVALID, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
    if (!tools && !kw) return PD_OK;
    *out = kw ? json_copy(kw) : json_object();
    if (!*out || (tools && json_object_set(*out, "tools", tools))) {
        json_decref(*out);
        *out = NULL;
        return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    }
    return PD_OK;
}

static pd_status render_chat(const pd_api_request *r, const pd_tok *tok, const pd_chat_template *tmpl,
                             pd_tok_ids *out, pd_api_error *e) {
    if (!tmpl) return fail(e, PD_ERR_INVALID, "messages", "this model has no chat template");
    json_t *extra = NULL;
    pd_status st = chat_extra(r, &extra, e);
    if (st) return st;
    char *text = NULL;
    size_t len = 0;
    pd_err jerr = {0};
    json_t *msgs = r->messages;
    bool tool_turns = r->tools != NULL;
    size_t mi;
    json_t *m;
    json_array_foreach(r->messages, mi, m) tool_turns |= json_object_get(m, "tool_calls") != NULL ||
                                                        !strcmp(json_string_value(json_object_get(m, "role")), "tool");
    if (r->tool_format == PD_API_TOOLS_FALLBACK && tool_turns &&
        !(msgs = pd_api_tools_fallback_messages(r->messages, r->tool_choice != PD_API_TOOL_CHOICE_NONE ? r->tools : NULL))) {
        json_decref(extra);
        return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    }
    st = pd_chat_template_apply(tmpl, msgs, true, extra, NULL, &text, &len, &jerr);
    if (msgs != r->messages) json_decref(msgs);
    json_decref(extra);
    if (st == PD_ERR_INVALID) return fail(e, st, "messages", "chat template error: %s", jerr.msg);
    if (st) return fail(e, st, NULL, "chat template: %s", jerr.msg);
    // The template writes BOS itself when it wants one: do not add a second (vLLM does the same).
    const char *bos = pd_chat_template_bos(tmpl);
    bool add_special = !(*bos && !strncmp(text, bos, strlen(bos)));
    json_t *as = json_object_get(r->root, "add_special_tokens");
    if (json_is_boolean(as)) add_special = json_is_true(as);
    st = encode_text(tok, text, len, add_special, out, "messages", e);
    pd_free(text);
    return st;
}

pd_status pd_api_request_tokenize(const pd_api_request *r, const pd_tok *tok,
                                  const pd_chat_template *tmpl, int max_model_len,
                                  pd_api_prompts *out, pd_api_error *err) {
    memset(out, 0, sizeof *out);
    pd_api_error tmp;
    pd_api_error *e = err ? err : &tmp;
    int n = (int)n_prompts(r);
    pd_api_prompts p = {0};
    p.items = pd_calloc((size_t)n, sizeof *p.items);
    p.max_tokens = pd_calloc((size_t)n, sizeof *p.max_tokens);
    if (!p.items || !p.max_tokens) {
        pd_free(p.items);
        pd_free(p.max_tokens);
        return fail(e, PD_ERR_NOMEM, NULL, "out of memory");
    }
    p.n = n;
    const char *param = r->kind == PD_API_CHAT ? "messages" : "prompt";
    pd_status st = PD_OK;
    for (int i = 0; i < r->n_logit_bias; i++)
        if (r->logit_bias[i].token >= pd_tok_n_vocab(tok)) {
            pd_api_prompts_fini(&p);
            return fail(e, PD_ERR_INVALID, "logit_bias", "logit_bias names token %d, beyond the vocabulary (%d tokens)",
                        r->logit_bias[i].token, pd_tok_n_vocab(tok));
        }
    if (r->max_tokens >= max_model_len) {
        pd_api_prompts_fini(&p);
        return fail(e, PD_ERR_INVALID, r->kind == PD_API_CHAT && field(r->root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
                    "max_tokens (%d) must be less than the model's maximum context length (%d tokens)", r->max_tokens,
                    max_model_len);
    }
    for (int i = 0; i < n && !st; i++) {
        pd_tok_ids *ids = &p.items[i];
        if (r->kind == PD_API_CHAT) {
            st = render_chat(r, tok, tmpl, ids, e);
        } else {
            json_t *x = json_is_string(r->prompt) || json_is_integer(json_array_get(r->prompt, 0))
                            ? r->prompt
                            : json_array_get(r->prompt, (size_t)i);
            if (json_is_string(x)) st = encode_text(tok, json_string_value(x), json_string_length(x), true, ids, param, e);
            else st = ids_from_json(tok, x, ids, e);
        }
        if (st) break;
        if (ids->n == 0) {
            st = fail(e, PD_ERR_INVALID, param, "the prompt is empty");
        } else if (r->continuation_tokens >= ids->n) {
            st = fail(e, PD_ERR_INVALID, "continuation_tokens", "'continuation_tokens' (%d) must be below the prompt's %d tokens",
                      r->continuation_tokens, ids->n);
        } else if (ids->n >= max_model_len) {
            st = fail(e, PD_ERR_INVALID, param,
                      "This model's maximum context length is %d tokens. However, your prompt has %d tokens "
                      "(leaving no room for a completion). Please reduce the length of the %s.",
                      max_model_len, ids->n, param);
        } else if (r->max_tokens > 0 && (long long)ids->n + r->max_tokens > max_model_len) {
            st = fail(e, PD_ERR_INVALID, param,
                      "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                      "(%d in the %s, %d in the completion). Please reduce the length of the %s or completion.",
                      max_model_len, (long long)ids->n + r->max_tokens, ids->n, param, r->max_tokens, param);
        }
        p.max_tokens[i] = r->max_tokens > 0 ? r->max_tokens : max_model_len - ids->n;
    }
    if (st) {
        pd_api_prompts_fini(&p);
        return st;
    }
    *out = p;
    return PD_OK;
}
