// response.c — the JSON shapes of OpenAI responses, built with jansson:
//
//   completions   {"id":"cmpl-…","object":"text_completion","created":…,"model":…,
//                  "choices":[{"index","text","logprobs","finish_reason"}],"usage":{…}}
//                 streaming chunks have the same object type, one choice each.
//   chat          {"id":"chatcmpl-…","object":"chat.completion",…,
//                  "choices":[{"index","message":{"role","content"},"logprobs","finish_reason"}]}
//                 streaming: "object":"chat.completion.chunk", choices[].delta = {"role"} first,
//                 then {"content"}, and {} with the finish_reason.
//                 With tool calls: message.tool_calls = [{"id","type":"function","function":{"name",
//                 "arguments" (a JSON string)}}] and content the text before them or null; streamed
//                 as one delta {"tool_calls":[{"index",...}]} per call; finish_reason "tool_calls".
//   usage         {"prompt_tokens","completion_tokens","total_tokens",
//                  "prompt_tokens_details":{"cached_tokens"}}
// With stream_options.include_usage every chunk carries "usage": null and a last chunk carries
// the usage with "choices": [] (OpenAI's documented behaviour).
#include <string.h>

#include "api/api_impl.h"

json_t *pd_api_usage_json(const api_job *j) {
    int n_completion = 0, n_cached = 0;
    for (int i = 0; i < j->n_choices; i++) {
        n_completion += j->choices[i].n_tokens;
        if (j->choices[i].index % j->n == 0) n_cached += j->choices[i].n_cached;  // once per prompt
    }
    json_t *u = json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", j->n_prompt_tokens, "completion_tokens",
                          n_completion, "total_tokens", j->n_prompt_tokens + n_completion, "prompt_tokens_details",
                          "cached_tokens", n_cached);
    if (u && j->include_timings) json_object_set_new(u, "ttft_breakdown", pd_api_ttft_json(j));
    // Extension (not in OpenAI's schema): speculative decoding's work for this request.
    int method = 0, drafted = 0, accepted = 0, steps = 0;
    for (int i = 0; i < j->n_choices; i++) {
        if (j->choices[i].spec_method) method = j->choices[i].spec_method;
        drafted += j->choices[i].n_spec_drafted;
        accepted += j->choices[i].n_spec_accepted;
        steps += j->choices[i].n_spec_steps;
    }
    if (u && method) {
        json_t *s = json_pack("{s:s,s:i,s:i,s:i,s:f,s:f}", "method", pd_engine_spec_method_name(method), "draft_tokens",
                              drafted, "accepted_tokens", accepted, "verify_steps", steps, "acceptance_rate",
                              drafted ? (double)accepted / drafted : 0.0, "mean_accepted_length",
                              steps ? (double)(accepted + steps) / steps : 0.0);
        if (s) json_object_set_new(u, "speculative", s);
    }
    return u;
}

static json_t *envelope(const api_job *j, bool is_chunk) {
    const char *obj = j->kind == PD_API_CHAT ? (is_chunk ? "chat.completion.chunk" : "chat.completion")
                                             : "text_completion";
    return json_pack("{s:s,s:s,s:I,s:s}", "id", j->id, "object", obj, "created", (json_int_t)j->created, "model",
                     j->api->model_name);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

json_t *pd_api_chunk_json(const api_job *j, const api_choice *c, const char *text, size_t len,
                          json_t *lp, const char *finish, const int32_t *ids, int n_ids) {
    json_t *o = envelope(j, true);
    json_t *ch = json_object();
    json_t *arr = json_array();
    if (!o || !ch || !arr) goto fail;
    json_object_set_new(ch, "index", json_integer(c->index));
    if (j->kind == PD_API_CHAT) {
        json_t *delta = json_object();
        if (!delta) goto fail;
        if (len || !finish) json_object_set_new(delta, "content", json_stringn(text ? text : "", len));
        json_object_set_new(ch, "delta", delta);
    } else {
        json_object_set_new(ch, "text", json_stringn(text ? text : "", len));
    }
    json_object_set_new(ch, "logprobs", lp ? lp : json_null());
    lp = NULL;
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    if (n_ids >= 0) json_object_set_new(ch, "token_ids", ids_json(ids, n_ids));
    json_array_append_new(arr, ch);
    ch = NULL;
    json_object_set_new(o, "choices", arr);
    if (j->include_usage) json_object_set_new(o, "usage", json_null());
    return o;
fail:
    json_decref(lp);
    json_decref(ch);
    json_decref(arr);
    json_decref(o);
    return NULL;
}

json_t *pd_api_tool_call_chunk_json(const api_job *j, const api_choice *c, int k, const json_t *call) {
    json_t *o = pd_api_chunk_json(j, c, "", 0, NULL, NULL, NULL, -1);
    json_t *ch = o ? json_array_get(json_object_get(o, "choices"), 0) : NULL;
    json_t *tc = json_deep_copy(call);
    if (!ch || !tc) {
        json_decref(o);
        json_decref(tc);
        return NULL;
    }
    json_object_set_new(tc, "index", json_integer(k));
    json_object_set_new(ch, "delta", json_pack("{s:[o]}", "tool_calls", tc));
    return o;
}

json_t *pd_api_usage_chunk_json(const api_job *j) {
    json_t *o = envelope(j, true);
    if (!o) return NULL;
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", pd_api_usage_json(j));
    return o;
}

json_t *pd_api_response_json(const api_job *j) {
    json_t *o = envelope(j, false);
    json_t *arr = json_array();
    if (!o || !arr) {
        json_decref(o);
        json_decref(arr);
        return NULL;
    }
    for (int i = 0; i < j->n_choices; i++) {
        const api_choice *c = &j->choices[i];
        json_t *ch = json_object();
        if (!ch) continue;
        json_object_set_new(ch, "index", json_integer(c->index));
        json_t *text = json_stringn(c->text ? c->text : "", c->tool_calls ? c->content_len : c->len);
        if (j->kind == PD_API_CHAT && c->tool_calls) {  // content: the text before the calls, or null
            if (!c->content_len) json_decref(text), text = json_null();
            json_object_set_new(ch, "message", json_pack("{s:s,s:o,s:O}", "role", "assistant", "content", text,
                                                         "tool_calls", c->tool_calls));
        } else if (j->kind == PD_API_CHAT)
            json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        else
            json_object_set_new(ch, "text", text);
        json_object_set_new(ch, "logprobs", c->lp ? json_incref(c->lp) : json_null());
        json_object_set_new(ch, "finish_reason", json_string(c->finish_reason ? c->finish_reason : "stop"));
        if (j->return_ids) json_object_set_new(ch, "token_ids", ids_json(c->ids.ids, c->ids.n));
        json_array_append_new(arr, ch);
    }
    json_object_set_new(o, "choices", arr);
    json_object_set_new(o, "usage", pd_api_usage_json(j));
    return o;
}

// The text of one token as clients see it (valid UTF-8; a partial character shows as U+FFFD).
static json_t *token_text(const pd_tok *tok, int32_t id) {
    char *s = NULL;
    size_t n = 0;
    if (pd_tok_decode(tok, &id, 1, false, &s, &n)) return NULL;
    json_t *v = json_stringn(s, n);
    pd_free(s);
    return v;
}

static json_t *token_bytes(const pd_tok *tok, int32_t id) {
    size_t n = 0;
    const char *b = pd_tok_token_bytes(tok, id, &n);
    json_t *arr = json_array();
    for (size_t i = 0; b && arr && i < n; i++) json_array_append_new(arr, json_integer((unsigned char)b[i]));
    return arr;
}

static pd_status append_chat(const pd_tok *tok, const pd_sample_result *r, json_t **acc) {
    if (!*acc && !(*acc = json_pack("{s:[]}", "content"))) return PD_ERR_NOMEM;
    json_t *top = json_array();
    for (int i = 0; top && i < r->n_top; i++)
        json_array_append_new(top, json_pack("{s:o,s:f,s:o}", "token", token_text(tok, r->top_ids[i]), "logprob",
                                             (double)r->top_logprobs[i], "bytes", token_bytes(tok, r->top_ids[i])));
    json_t *e = json_pack("{s:o,s:f,s:o,s:o}", "token", token_text(tok, r->token), "logprob", (double)r->logprob,
                          "bytes", token_bytes(tok, r->token), "top_logprobs", top);
    if (!e) return PD_ERR_NOMEM;
    return json_array_append_new(json_object_get(*acc, "content"), e) ? PD_ERR_NOMEM : PD_OK;
}

static pd_status append_completion(const pd_tok *tok, const pd_sample_result *r, size_t text_offset,
                                   json_t **acc) {
    if (!*acc && !(*acc = json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs",
                                    "text_offset")))
        return PD_ERR_NOMEM;
    json_t *top = json_object();
    for (int i = 0; top && i < r->n_top; i++) {
        json_t *t = token_text(tok, r->top_ids[i]);
        if (t) json_object_set_new(top, json_string_value(t), json_real((double)r->top_logprobs[i]));
        json_decref(t);
    }
    int bad = 0;
    bad |= json_array_append_new(json_object_get(*acc, "tokens"), token_text(tok, r->token));
    bad |= json_array_append_new(json_object_get(*acc, "token_logprobs"), json_real((double)r->logprob));
    bad |= json_array_append_new(json_object_get(*acc, "top_logprobs"), top);
    bad |= json_array_append_new(json_object_get(*acc, "text_offset"), json_integer((json_int_t)text_offset));
    return bad ? PD_ERR_NOMEM : PD_OK;
}

pd_status pd_api_logprobs_append(const api_job *j, const pd_tok *tok, const pd_sample_result *r,
                                  size_t text_offset, json_t **acc) {
    return j->kind == PD_API_CHAT ? append_chat(tok, r, acc) : append_completion(tok, r, text_offset, acc);
}
