// tools.c — tool calling: which syntax a chat template uses, the prompt for templates without tool
// support, the grammar that enforces "required" / named tool choices, and parsing calls out of the
// generated text (api.h has the contract).
//
//   format     the model writes                                       detected by (template source)
//   HERMES     <tool_call>\n{"name": N, "arguments": {..}}\n</tool_call>   "<tool_call>"
//   MISTRAL    [TOOL_CALLS][{"name": N, "arguments": {..}}, ...]          "[TOOL_CALLS]"
//   LLAMA3     {"name": N, "parameters": {..}}                           "<|python_tag|>" / "ipython"
//   FALLBACK   as HERMES; the system message describing the tools is ours  (no "tools" in the source)
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "api/api_impl.h"
#include "base/buf.h"

pd_api_tool_format pd_api_tool_format_detect(const char *src) {
    if (!src || !strstr(src, "tools")) return PD_API_TOOLS_FALLBACK;
    if (strstr(src, "<tool_call>")) return PD_API_TOOLS_HERMES;
    if (strstr(src, "[TOOL_CALLS]")) return PD_API_TOOLS_MISTRAL;
    if (strstr(src, "<|python_tag|>") || strstr(src, "ipython")) return PD_API_TOOLS_LLAMA3;
    return PD_API_TOOLS_HERMES;  // renders tools but says nothing of the syntax: the common one
}

static const char *args_key(pd_api_tool_format f) { return f == PD_API_TOOLS_LLAMA3 ? "parameters" : "arguments"; }

// ---- the prompt for templates without tool support -------------------------------------------------

static pd_status append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    pd_buf b = {*buf, *len, *cap};  // the triple keeps pd_buf's invariant (cap >= len + 1 once allocated)
    if (pd_buf_append(&b, s, n)) return PD_ERR_NOMEM;
    *buf = b.p;
    *len = b.len;
    *cap = b.cap;
    return PD_OK;
}
#define APPEND(s) append(&buf, &len, &cap, (s), strlen(s))

// Qwen2.5's wording (the Hermes format); one JSON line per tool.
static json_t *tools_system_text(const json_t *tools, const char *prefix) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int bad = 0;
    if (prefix && *prefix) bad |= APPEND(prefix) | APPEND("\n\n");
    bad |= APPEND("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char *s = json_dumps(t, JSON_COMPACT);
        if (!s) return pd_free(buf), NULL;
        bad |= APPEND("\n") | APPEND(s);
        free(s);
    }
    bad |= APPEND("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}\n</tool_call>");
    json_t *o = bad ? NULL : json_stringn(buf, len);
    pd_free(buf);
    return o;
}

json_t *pd_api_tools_fallback_messages(const json_t *messages, const json_t *tools) {
    json_t *out = json_array();
    if (!out) return NULL;
    size_t i;
    json_t *m;
    bool injected = false;
    json_array_foreach(messages, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *content = json_string_value(json_object_get(m, "content"));
        json_t *n = json_deep_copy(m);
        if (!n || json_array_append_new(out, n)) goto fail;
        if (!injected && tools && i == 0 && role && !strcmp(role, "system")) {
            json_t *sys = tools_system_text(tools, content);
            if (!sys) goto fail;
            json_object_set_new(n, "content", sys);
            injected = true;
        }
        json_t *calls = json_object_get(m, "tool_calls");
        if (role && !strcmp(role, "assistant") && json_is_array(calls) && json_array_size(calls)) {
            char *buf = NULL;
            size_t len = 0, cap = 0;
            int bad = content && *content ? APPEND(content) : 0;
            size_t k;
            json_t *c;
            json_array_foreach(calls, k, c) {
                json_t *fn = json_object_get(c, "function");
                json_t *call = json_pack("{s:O,s:O}", "name", json_object_get(fn, "name"), "arguments",
                                         json_object_get(fn, "arguments"));
                char *s = call ? json_dumps(call, JSON_COMPACT) : NULL;
                json_decref(call);
                if (!s) {
                    pd_free(buf);
                    goto fail;
                }
                bad |= APPEND(len ? "\n<tool_call>\n" : "<tool_call>\n") | APPEND(s) | APPEND("\n</tool_call>");
                free(s);
            }
            json_object_del(n, "tool_calls");
            json_object_set_new(n, "content", bad ? NULL : json_stringn(buf, len));
            pd_free(buf);
            if (bad) goto fail;
        } else if (role && !strcmp(role, "tool")) {
            char *buf = NULL;
            size_t len = 0, cap = 0;
            int bad = APPEND("<tool_response>\n") | APPEND(content ? content : "") | APPEND("\n</tool_response>");
            json_object_set_new(n, "role", json_string("user"));
            json_object_set_new(n, "content", bad ? NULL : json_stringn(buf, len));
            pd_free(buf);
            if (bad) goto fail;
        }
    }
    if (!injected && tools) {
        json_t *sys = tools_system_text(tools, NULL);
        json_t *msg = sys ? json_pack("{s:s,s:o}", "role", "system", "content", sys) : NULL;
        if (!msg || json_array_insert_new(out, 0, msg)) goto fail;
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

// ---- the grammar of "required" / named tool choices -----------------------------------------------

// One rule "tcall" = any allowed function's call object; rules of function i prefixed "t<i>-".
static pd_status call_rules(const pd_api_request *r, pd_api_tool_format f, char **buf, size_t *len, size_t *cap,
                            pd_err *err) {
    size_t i;
    json_t *t;
    char line[256];
    int n = 0;
    size_t mark = *len;
    json_array_foreach(r->tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (r->tool_choice == PD_API_TOOL_CHOICE_NAMED && strcmp(name, r->tool_name)) continue;
        json_t *params = json_object_get(fn, "parameters");
        json_t *empty = NULL;
        if (!params || json_is_null(params)) params = empty = json_pack("{s:s,s:{}}", "type", "object", "properties");
        char prefix[32];
        snprintf(prefix, sizeof prefix, "t%zu-", i);
        pd_status st = pd_grammar_schema_rules(params, prefix, buf, len, cap, err);
        json_decref(empty);
        if (st) {
            if (st == PD_ERR_INVALID) {
                char msg[sizeof err->msg];
                snprintf(msg, sizeof msg, "%s", err->msg);
                pd_err_set(err, PD_ERR_INVALID, "tools[%zu] (%s) parameters: %s", i, name, msg);
            }
            return st;
        }
        // tcall-i ::= "{\"name\": \"NAME\", \"arguments\": " t<i>-root "}"
        snprintf(line, sizeof line, "tcall-%zu ::= \"{\\\"name\\\": \\\"%s\\\", \\\"%s\\\": \" %sroot \"}\"\n", i, name,
                 args_key(f), prefix);
        if (append(buf, len, cap, line, strlen(line))) return PD_ERR_NOMEM;
        n++;
    }
    (void)mark;
    if (append(buf, len, cap, "tcall ::= ", 10)) return PD_ERR_NOMEM;
    int k = 0;
    json_array_foreach(r->tools, i, t) {
        const char *name = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (r->tool_choice == PD_API_TOOL_CHOICE_NAMED && strcmp(name, r->tool_name)) continue;
        snprintf(line, sizeof line, "%stcall-%zu", k++ ? " | " : "", i);
        if (append(buf, len, cap, line, strlen(line))) return PD_ERR_NOMEM;
    }
    return append(buf, len, cap, "\n", 1) ? PD_ERR_NOMEM : (n ? PD_OK : PD_ERR_INVALID);
}

pd_status pd_api_tools_gbnf(const pd_api_request *r, pd_api_tool_format f, char **out, pd_err *err) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    pd_status st = call_rules(r, f, &buf, &len, &cap, err);
    // More than one call only when parallel calls are allowed and no function is named (4 at most:
    // a small model would otherwise go on calling until max_tokens).
    bool many = r->parallel_tool_calls && r->tool_choice == PD_API_TOOL_CHOICE_REQUIRED;
    const char *root = NULL;
    switch (f) {
    case PD_API_TOOLS_MISTRAL:
        root = many ? "root ::= \"[TOOL_CALLS][\" tcall ( \", \" tcall ){0,3} \"]\"\n" : "root ::= \"[TOOL_CALLS][\" tcall \"]\"\n";
        break;
    case PD_API_TOOLS_LLAMA3: root = "root ::= tcall\n"; break;  // one call per turn (Llama 3.1's prompt)
    default:
        root = many ? "root ::= hcall ( \"\\n\" hcall ){0,3}\nhcall ::= \"<tool_call>\\n\" tcall \"\\n</tool_call>\"\n"
                    : "root ::= \"<tool_call>\\n\" tcall \"\\n</tool_call>\"\n";
        break;
    }
    if (!st && append(&buf, &len, &cap, root, strlen(root))) st = PD_ERR_NOMEM;
    if (st) {
        if (st == PD_ERR_NOMEM) pd_err_set(err, st, "out of memory");
        pd_free(buf);
        *out = NULL;
        return st;
    }
    *out = buf;
    return PD_OK;
}

// ---- parsing calls out of the text -----------------------------------------------------------------

static bool known_tool(const json_t *tools, const char *name) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) if (!strcmp(json_string_value(json_object_get(json_object_get(t, "function"), "name")), name)) return true;
    return false;
}

// Appends {"id","type","function":{"name","arguments"}} for a parsed call object; false if it is
// not a call of a known tool.
static bool add_call(json_t *calls, const json_t *obj, pd_api_tool_format f, const json_t *tools, pd_rng *rng) {
    const char *name = json_string_value(json_object_get(obj, "name"));
    json_t *args = json_object_get(obj, args_key(f));
    if (!args) args = json_object_get(obj, f == PD_API_TOOLS_LLAMA3 ? "arguments" : "parameters");
    if (!name || !known_tool(tools, name)) return false;
    char *a = NULL;
    if (json_is_string(args)) a = strdup(json_string_value(args));
    else a = json_dumps(args ? args : json_object(), JSON_COMPACT | JSON_ENCODE_ANY);
    if (!a) return false;
    // OpenAI's shape "call_" + 24; Mistral's templates refuse anything but 9 alphanumerics (as vLLM).
    char id[40] = "call_";
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    int pre = f == PD_API_TOOLS_MISTRAL ? 0 : 5, n = f == PD_API_TOOLS_MISTRAL ? 9 : 24;
    for (int i = 0; i < n; i++) id[pre + i] = al[pd_rng_next(rng) % (sizeof al - 1)];
    id[pre + n] = 0;
    json_t *c = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function", "name", name, "arguments", a);
    free(a);
    return c && !json_array_append_new(calls, c);
}

static const char *skip_ws(const char *s, const char *end) {
    while (s < end && isspace((unsigned char)*s)) s++;
    return s;
}

static const char *find(const char *s, const char *end, const char *needle) {
    size_t n = strlen(needle);
    for (; s + n <= end; s++)
        if (!memcmp(s, needle, n)) return s;
    return NULL;
}

json_t *pd_api_tools_parse(const char *text, size_t n, pd_api_tool_format f, const json_t *tools, pd_rng *rng,
                           size_t *content_len) {
    const char *end = text + n, *start = NULL;
    json_t *calls = json_array();
    if (!calls) return NULL;
    if (f == PD_API_TOOLS_MISTRAL) {
        const char *p = find(text, end, "[TOOL_CALLS]");
        const char *arr = p ? p + 12 : skip_ws(text, end);
        if (p || (arr < end && *arr == '[')) {
            json_t *a = json_loadb(arr, (size_t)(end - arr), JSON_DISABLE_EOF_CHECK, NULL);
            size_t i;
            json_t *o;
            bool ok = json_is_array(a) && json_array_size(a);
            json_array_foreach(a, i, o) ok = ok && add_call(calls, o, f, tools, rng);
            json_decref(a);
            if (ok) start = p ? p : arr;
        }
    } else if (f == PD_API_TOOLS_LLAMA3) {
        const char *p = skip_ws(text, end);
        if (end - p >= 14 && !memcmp(p, "<|python_tag|>", 14)) p = skip_ws(p + 14, end);
        json_t *o = p < end && *p == '{' ? json_loadb(p, (size_t)(end - p), 0, NULL) : NULL;
        if (json_is_object(o) && add_call(calls, o, f, tools, rng)) start = text;
        json_decref(o);
    } else {
        const char *p = text;
        for (;;) {
            const char *a = find(p, end, "<tool_call>");
            if (!a) break;
            const char *b = find(a, end, "</tool_call>");
            const char *body = a + 11, *body_end = b ? b : end;
            json_t *o = json_loadb(body, (size_t)(body_end - body), 0, NULL);
            bool ok = json_is_object(o) && add_call(calls, o, f, tools, rng);
            json_decref(o);
            if (!ok) break;
            if (!start) start = a;
            if (!b) break;
            p = b + 12;
        }
    }
    if (!start || !json_array_size(calls)) {
        json_decref(calls);
        return NULL;
    }
    // Content: the text before the first call, without trailing blanks.
    const char *c = start;
    while (c > text && isspace((unsigned char)c[-1])) c--;
    *content_len = (size_t)(c - text);
    return calls;
}

bool pd_api_tools_may_open(pd_api_tool_format f, char c) {
    switch (f) {
    case PD_API_TOOLS_MISTRAL: return c == '[';
    case PD_API_TOOLS_LLAMA3: return c == '{' || c == '<';
    default: return c == '<';
    }
}
