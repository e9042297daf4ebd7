// test_api_request.c — OpenAI request parsing and validation without an engine: every bad-input
// case gives the right status (→ HTTP status through pd_api_status_http), names the right param,
// and leaves nothing allocated; good inputs fill pd_api_request as documented. The tokenize step
// runs against the real kjv-llama-6m tokenizer (PD_MODELS_DIR): prompts of every shape, chat
// rendering with and without a BOS in the template, vocabulary and context-length checks.
#include "test.h"

#include "api/api_impl.h"

// ---- helpers -----------------------------------------------------------------------------------

static pd_status parse(pd_api_kind k, const char *body, pd_api_request *r, pd_api_error *e) {
    return pd_api_request_parse(k, body, strlen(body), "kjv", r, e);
}

// Expects body to be rejected with HTTP status `http` naming `param` ("" = JSON null).
static void expect_bad_(pd_api_kind k, const char *body, int http, const char *param, int line) {
    pd_api_request r;
    pd_api_error e;
    pd_status st = parse(k, body, &r, &e);
    int got = pd_api_status_http(st, NULL);
    if (st == PD_OK || got != http || strcmp(e.param, param)) {
        fprintf(stderr, "  line %d: body %s: status %s http %d param '%s' msg '%s' (want http %d param '%s')\n", line,
                body, pd_status_str(st), got, st ? e.param : "", st ? e.message : "", http, param);
        pd_test_failed_ = 1;
    }
    pd_n_checks_++;
    PD_CHECK(r.root == NULL && r.messages == NULL);  // zeroed on failure
    if (st == PD_OK) pd_api_request_fini(&r);
}
#define EXPECT_BAD(k, body, http, param) expect_bad_(k, body, http, param, __LINE__)
#define C PD_API_COMPLETION
#define CH PD_API_CHAT

// ---- the status mapping ------------------------------------------------------------------------

PD_TEST(status_mapping) {
    const char *t;
    PD_CHECK_EQ(pd_api_status_http(PD_OK, NULL), 200);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_INVALID, &t), 400);
    PD_CHECK_STR(t, "invalid_request_error");
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_PROTO, &t), 400);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_UNSUPPORTED, &t), 400);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_NOTFOUND, &t), 404);
    PD_CHECK_STR(t, "invalid_request_error");
    PD_CHECK_EQ(pd_api_status_http(PD_NOSPACE, &t), 503);
    PD_CHECK_STR(t, "server_error");
    PD_CHECK_EQ(pd_api_status_http(PD_AGAIN, &t), 503);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_TIMEOUT, &t), 504);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_NOMEM, &t), 500);
    PD_CHECK_STR(t, "server_error");
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_IO, NULL), 500);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_DEVICE, NULL), 500);
    PD_CHECK_EQ(pd_api_status_http(PD_ERR_CLOSED, NULL), 500);
}

// ---- good requests -----------------------------------------------------------------------------

PD_TEST(completion_defaults) {
    pd_api_request r;
    pd_api_error e;
    PD_REQUIRE(parse(C, "{\"prompt\":\"hi\"}", &r, &e) == PD_OK);
    PD_CHECK_EQ(r.kind, C);
    PD_CHECK(r.model == NULL);
    PD_CHECK(json_is_string(r.prompt));
    PD_CHECK_EQ(r.max_tokens, -1);
    PD_CHECK_EQ(r.n, 1);
    PD_CHECK(!r.stream && !r.include_usage && !r.ignore_eos && r.skip_special_tokens);
    PD_CHECK_EQ(r.logprobs, -1);
    PD_CHECK_EQ(r.sampling.n_logprobs, -1);
    PD_CHECK_NEAR(r.sampling.temperature, 1.0, 0);
    PD_CHECK_NEAR(r.sampling.top_p, 1.0, 0);
    PD_CHECK(!r.sampling.has_seed);
    PD_CHECK_EQ(r.n_stops, 0);
    pd_api_request_fini(&r);
    pd_api_request_fini(&r);  // idempotent on a zeroed request
}

PD_TEST(completion_all_fields) {
    const char *body =
        "{\"model\":\"kjv\",\"prompt\":[1,2,3],\"max_tokens\":7.0,\"n\":3,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true},\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,"
        "\"min_p\":0.05,\"seed\":-5,\"stop\":[\"a\",\"bc\"],\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
        "\"repetition_penalty\":1.1,\"logprobs\":3,\"ignore_eos\":true,\"echo\":false,\"user\":\"u\","
        "\"priority\":-2,\"stop_token_ids\":[5,6],\"best_of\":3,\"metadata\":{\"x\":\"1\"},"
        "\"return_token_ids\":true}";
    pd_api_request r;
    pd_api_error e;
    PD_REQUIRE(parse(C, body, &r, &e) == PD_OK);
    PD_CHECK_STR(r.model, "kjv");
    PD_CHECK_EQ(r.max_tokens, 7);
    PD_CHECK_EQ(r.n, 3);
    PD_CHECK(r.stream && r.include_usage && r.ignore_eos);
    PD_CHECK_NEAR(r.sampling.temperature, 0.5, 1e-6);
    PD_CHECK_NEAR(r.sampling.top_p, 0.9, 1e-6);
    PD_CHECK_EQ(r.sampling.top_k, 40);
    PD_CHECK_NEAR(r.sampling.min_p, 0.05, 1e-6);
    PD_CHECK(r.sampling.has_seed);
    PD_CHECK_EQ((int64_t)r.sampling.seed, -5);
    PD_CHECK_EQ(r.n_stops, 2);
    PD_CHECK_STR(r.stops[1], "bc");
    PD_CHECK_NEAR(r.sampling.repetition_penalty, 1.1, 1e-6);
    PD_CHECK_EQ(r.logprobs, 3);
    PD_CHECK_EQ(r.sampling.n_logprobs, 3);
    PD_CHECK_EQ(r.priority, -2);
    PD_CHECK_EQ(r.n_stop_ids, 2);
    PD_CHECK_EQ(r.stop_ids[1], 6);
    PD_CHECK(r.return_token_ids);
    pd_api_request_fini(&r);
    // Nulls mean "not given".
    PD_REQUIRE(parse(C, "{\"prompt\":\"x\",\"max_tokens\":null,\"stop\":null,\"logprobs\":null,\"seed\":null}", &r, &e) ==
               PD_OK);
    PD_CHECK_EQ(r.max_tokens, -1);
    PD_CHECK_EQ(r.logprobs, -1);
    pd_api_request_fini(&r);
    PD_REQUIRE(parse(C, "{\"prompt\":\"x\",\"stop\":\"###\"}", &r, &e) == PD_OK);
    PD_CHECK_EQ(r.n_stops, 1);
    PD_CHECK_STR(r.stops[0], "###");
    pd_api_request_fini(&r);
}

PD_TEST(chat_fields_and_messages) {
    const char *body =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
        "{\"role\":\"assistant\",\"content\":null}],"
        "\"max_tokens\":100,\"max_completion_tokens\":9,\"logprobs\":true,\"top_logprobs\":2}";
    pd_api_request r;
    pd_api_error e;
    PD_REQUIRE(parse(CH, body, &r, &e) == PD_OK);
    PD_CHECK_EQ(r.max_tokens, 9);  // max_completion_tokens wins
    PD_CHECK_EQ(r.logprobs, 2);
    PD_REQUIRE(json_array_size(r.messages) == 3);
    PD_CHECK_STR(json_string_value(json_object_get(json_array_get(r.messages, 1), "content")), "a\nb");
    PD_CHECK_STR(json_string_value(json_object_get(json_array_get(r.messages, 2), "content")), "");
    PD_CHECK_STR(json_string_value(json_object_get(json_array_get(r.messages, 0), "role")), "system");
    pd_api_request_fini(&r);
    PD_REQUIRE(parse(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", &r, &e) == PD_OK);
    PD_CHECK_EQ(r.logprobs, 0);
    pd_api_request_fini(&r);
    PD_REQUIRE(parse(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":false}", &r, &e) == PD_OK);
    PD_CHECK_EQ(r.logprobs, -1);
    pd_api_request_fini(&r);
}

// ---- bad requests ------------------------------------------------------------------------------

PD_TEST(bad_body_and_model) {
    EXPECT_BAD(C, "", 400, "");
    EXPECT_BAD(C, "{", 400, "");
    EXPECT_BAD(C, "{\"prompt\":\"x\",}", 400, "");
    EXPECT_BAD(C, "[1,2]", 400, "");
    EXPECT_BAD(C, "\"prompt\"", 400, "");
    EXPECT_BAD(C, "null", 400, "");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"model\":\"gpt-4\"}", 404, "model");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"model\":\"other\"}", 404, "model");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"model\":5}", 400, "model");
    pd_api_request r;
    pd_api_error e;
    PD_CHECK_EQ(parse(C, "{\"prompt\":\"x\",\"model\":\"gpt-4\"}", &r, &e), PD_ERR_NOTFOUND);
    PD_CHECK_STR(e.code, "model_not_found");
    PD_CHECK_CONTAINS(e.message, "gpt-4");
    // Any model is accepted when the server does not check.
    const char *any = "{\"prompt\":\"x\",\"model\":\"m\"}";
    PD_CHECK_EQ(pd_api_request_parse(C, any, strlen(any), NULL, &r, &e), PD_OK);
    pd_api_request_fini(&r);
}

PD_TEST(bad_prompt) {
    EXPECT_BAD(C, "{}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":null}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":5}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":{}}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[1,\"a\"]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[\"a\",2]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[true]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[[]]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[[1],[\"a\"]]}", 400, "prompt");
    EXPECT_BAD(C, "{\"prompt\":[1.5]}", 400, "prompt");
}

PD_TEST(bad_messages) {
    EXPECT_BAD(CH, "{}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":\"hi\"}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[\"hi\"]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":5,\"content\":\"hi\"}]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}", 400,
               "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", 400, "messages");
}

PD_TEST(bad_numbers) {
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":-1}", 400, "max_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":\"10\"}", 400, "max_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "max_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":1099511627776}", 400, "max_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"max_tokens\":true}", 400, "max_tokens");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}", 400,
               "max_completion_tokens");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"n\":0}", 400, "n");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"n\":17}", 400, "n");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"n\":\"2\"}", 400, "n");
    EXPECT_BAD(C, "{\"prompt\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\"],\"n\":15}", 400, "n");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"temperature\":-0.1}", 400, "temperature");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"temperature\":1000}", 400, "temperature");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"top_k\":-2}", 400, "top_k");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"top_k\":2.5}", 400, "top_k");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"min_p\":2}", 400, "min_p");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"presence_penalty\":3}", 400, "presence_penalty");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"frequency_penalty\":-2.5}", 400, "frequency_penalty");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"repetition_penalty\":0}", 400, "repetition_penalty");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"seed\":\"x\"}", 400, "seed");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"priority\":\"high\"}", 400, "priority");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"best_of\":3}", 400, "best_of");
}

PD_TEST(bad_flags_and_lists) {
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400, "stream_options");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":5}", 400, "stream_options");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400, "stream_options");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"echo\":true}", 400, "echo");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"echo\":\"no\"}", 400, "echo");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"suffix\":\"end\"}", 400, "suffix");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"ignore_eos\":1}", 400, "ignore_eos");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"return_token_ids\":\"yes\"}", 400, "return_token_ids");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop\":\"\"}", 400, "stop");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop\":5}", 400, "stop");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop\":[\"a\",1]}", 400, "stop");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", 400, "stop");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\","
                  "\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
               400, "stop");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop_token_ids\":[-1]}", 400, "stop_token_ids");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"stop_token_ids\":\"5\"}", 400, "stop_token_ids");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logprobs\":21}", 400, "logprobs");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logprobs\":-1}", 400, "logprobs");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":3}", 400, "logprobs");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":3}", 400, "top_logprobs");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}", 400,
               "top_logprobs");
    // 16 stop strings are fine.
    pd_api_request r;
    pd_api_error e;
    PD_CHECK_EQ(parse(C, "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\","
                         "\"12\",\"13\",\"14\",\"15\",\"16\"]}",
                      &r, &e),
                PD_OK);
    PD_CHECK_EQ(r.n_stops, 16);
    pd_api_request_fini(&r);
}

// The field policy: every field is known or refused; harmless ones are accepted.
PD_TEST(field_policy) {
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"respose_format\":{}}", 400, "respose_format");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"some_future_field\":1}", 400, "some_future_field");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"messages\":[]}", 400, "messages");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true}", 400, "echo");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"audio\":{\"voice\":\"a\"}}", 400, "audio");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"functions\":[]}", 400, "functions");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"modalities\":[\"audio\"]}", 400, "modalities");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"reasoning_effort\":\"low\"}", 400, "reasoning_effort");
    pd_api_request r;
    pd_api_error e;
    PD_CHECK(parse(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"u\",\"metadata\":{\"a\":\"b\"},"
                       "\"store\":false,\"service_tier\":\"auto\",\"modalities\":[\"text\"],\"parallel_tool_calls\":false,"
                       "\"audio\":null}",
                   &r, &e) == PD_OK);
    pd_api_request_fini(&r);
}

PD_TEST(constraints_tools_and_bias) {
    pd_api_request r;
    pd_api_error e;
    PD_REQUIRE(parse(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_schema\","
                         "\"json_schema\":{\"name\":\"n\",\"strict\":true,\"schema\":{\"type\":\"object\"}}},"
                         "\"logit_bias\":{\"5\":-100,\"7\":2.5}}",
                     &r, &e) == PD_OK);
    PD_CHECK_EQ(r.format, PD_API_FORMAT_JSON_SCHEMA);
    PD_CHECK(json_is_object(r.schema));
    PD_CHECK_EQ(r.n_logit_bias, 2);
    PD_CHECK(r.logit_bias[0].token == 5 && r.logit_bias[0].bias == -100.0f && r.logit_bias[1].token == 7);
    PD_CHECK_EQ(r.tool_choice, PD_API_TOOL_CHOICE_NONE);
    pd_api_request_fini(&r);
    PD_REQUIRE(parse(C, "{\"prompt\":\"x\",\"grammar\":\"root ::= \\\"a\\\"\"}", &r, &e) == PD_OK);
    PD_CHECK_EQ(r.format, PD_API_FORMAT_GRAMMAR);
    pd_api_request_fini(&r);
    const char *tools = "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}},"
                        "{\"type\":\"function\",\"function\":{\"name\":\"g-2\"}}]";
    char body[1024];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,\"tool_choice\":{\"type\":\"function\","
             "\"function\":{\"name\":\"g-2\"}}}", tools);
    PD_REQUIRE(parse(CH, body, &r, &e) == PD_OK);
    PD_CHECK(r.tool_choice == PD_API_TOOL_CHOICE_NAMED && !strcmp(r.tool_name, "g-2") && r.parallel_tool_calls);
    pd_api_request_fini(&r);
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}", tools);
    PD_REQUIRE(parse(CH, body, &r, &e) == PD_OK);
    PD_CHECK(r.tool_choice == PD_API_TOOL_CHOICE_AUTO && json_array_size(r.tools) == 2);
    pd_api_request_fini(&r);
    // Assistant tool calls and tool results are accepted; arguments reach templates as objects.
    PD_REQUIRE(parse(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":null,"
                         "\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}}]},"
                         "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\"}]}",
                     &r, &e) == PD_OK);
    json_t *args = json_object_get(json_object_get(json_array_get(json_object_get(json_array_get(r.messages, 1), "tool_calls"), 0),
                                                   "function"), "arguments");
    PD_CHECK(json_is_object(args) && json_integer_value(json_object_get(args, "a")) == 1);
    pd_api_request_fini(&r);

    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"xml\"}}", 400, "response_format");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_schema\"}}", 400, "response_format");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"grammar\":\"\"}", 400, "grammar");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"grammar\":\"root ::= x\",\"response_format\":{\"type\":\"json_object\"}}", 400, "grammar");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"},\"ignore_eos\":true}", 400, "ignore_eos");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logit_bias\":{\"a\":1}}", 400, "logit_bias");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logit_bias\":{\"1\":101}}", 400, "logit_bias");
    EXPECT_BAD(C, "{\"prompt\":\"x\",\"logit_bias\":[1]}", 400, "logit_bias");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"code\"}]}", 400, "tools");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}", 400, "tools");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}", 400, "tool_choice");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"sometimes\"}", 400, "tool_choice");
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,\"tool_choice\":{\"type\":\"function\","
             "\"function\":{\"name\":\"h\"}}}", tools);
    EXPECT_BAD(CH, body, 400, "tool_choice");
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,\"tool_choice\":\"required\","
             "\"response_format\":{\"type\":\"json_object\"}}", tools);
    EXPECT_BAD(CH, body, 400, "tool_choice");
    EXPECT_BAD(CH, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{oops\"}}]}]}", 400, "messages");
}

PD_TEST(tool_formats_and_parsing) {
    PD_CHECK_EQ(pd_api_tool_format_detect(NULL), PD_API_TOOLS_FALLBACK);
    PD_CHECK_EQ(pd_api_tool_format_detect("{% for m in messages %}{{ m.content }}{% endfor %}"), PD_API_TOOLS_FALLBACK);
    static const struct {
        const char *file;
        pd_api_tool_format want;
    } fx[] = {{"qwen25.jinja", PD_API_TOOLS_HERMES}, {"mistral_v03.jinja", PD_API_TOOLS_MISTRAL},
              {"llama31.jinja", PD_API_TOOLS_LLAMA3}, {"llama32.jinja", PD_API_TOOLS_LLAMA3},
              {"qwen2.jinja", PD_API_TOOLS_FALLBACK}, {"llama2.jinja", PD_API_TOOLS_FALLBACK}};
    for (size_t i = 0; i < PD_ARRAY_LEN(fx); i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/tests/data/chat/%s", pd_test_repo_dir(), fx[i].file);
        FILE *f = fopen(path, "rb");
        PD_REQUIRE(f);
        char *buf = pd_calloc(1, 1 << 16);
        size_t n = fread(buf, 1, (1 << 16) - 1, f);
        fclose(f);
        PD_CHECK(n > 0);
        PD_CHECK_MSG(pd_api_tool_format_detect(buf) == fx[i].want, "%s: %d", fx[i].file, pd_api_tool_format_detect(buf));
        pd_free(buf);
    }
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},{\"type\":\"function\",\"function\":{\"name\":\"g\"}}]", 0, NULL);
    pd_rng rng;
    pd_rng_seed(&rng, 1);
    size_t clen = 99;
    const char *h = "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    json_t *calls = pd_api_tools_parse(h, strlen(h), PD_API_TOOLS_HERMES, tools, &rng, &clen);
    PD_REQUIRE(json_array_size(calls) == 2);
    PD_CHECK_EQ(clen, 12);
    json_t *fn = json_object_get(json_array_get(calls, 0), "function");
    PD_CHECK_STR(json_string_value(json_object_get(fn, "name")), "f");
    PD_CHECK_STR(json_string_value(json_object_get(fn, "arguments")), "{\"a\":1}");
    PD_CHECK_EQ(strlen(json_string_value(json_object_get(json_array_get(calls, 0), "id"))), 29);
    json_decref(calls);
    const char *m = "[TOOL_CALLS][{\"name\": \"g\", \"arguments\": {\"x\": [1]}}]";
    calls = pd_api_tools_parse(m, strlen(m), PD_API_TOOLS_MISTRAL, tools, &rng, &clen);
    PD_CHECK(json_array_size(calls) == 1 && clen == 0);
    PD_CHECK_EQ(strlen(json_string_value(json_object_get(json_array_get(calls, 0), "id"))), 9);  // Mistral's ids
    json_decref(calls);
    const char *l = " {\"name\": \"f\", \"parameters\": {\"q\": \"a\"}}";
    calls = pd_api_tools_parse(l, strlen(l), PD_API_TOOLS_LLAMA3, tools, &rng, &clen);
    PD_CHECK(json_array_size(calls) == 1);
    json_decref(calls);
    // Not calls: unknown function, broken JSON, plain text.
    const char *bad[] = {"<tool_call>{\"name\": \"zz\", \"arguments\": {}}</tool_call>", "<tool_call>{\"name\": \"f\"",
                         "In the beginning"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++)
        PD_CHECK(!pd_api_tools_parse(bad[i], strlen(bad[i]), PD_API_TOOLS_HERMES, tools, &rng, &clen));
    json_decref(tools);
}

PD_TEST(parse_survives_allocation_failures) {
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"}]}],"
                       "\"stop\":[\"x\"],\"n\":2}";
    for (long k = 0; k < 64; k++) {
        pd_mem_fault_set(k, false);
        pd_api_request r;
        pd_api_error e;
        pd_status st = parse(CH, body, &r, &e);
        pd_mem_fault_set(-1, false);
        if (st == PD_OK) pd_api_request_fini(&r);
        else PD_CHECK(st == PD_ERR_NOMEM || st == PD_ERR_INVALID);
    }
}

// ---- tokenize (real tokenizer) -----------------------------------------------------------------

static pd_tok *load_tok(void) {
    char path[1024];
    pd_err err = {0};
    pd_tok *t = pd_tok_load(pd_test_path(path, sizeof path, "kjv-llama-6m"), &err);
    PD_CHECK_MSG(t != NULL, "tokenizer: %s", err.msg);
    return t;
}

static pd_chat_template *tmpl_of(const char *src) {
    pd_err err = {0};
    pd_chat_template *t = pd_chat_template_new(src, strlen(src), "<|begin_of_text|>", "<|end_of_text|>", &err);
    PD_CHECK_MSG(t != NULL, "template: %s", err.msg);
    return t;
}

static pd_status tokenize(pd_api_kind k, const char *body, const pd_tok *tok, const pd_chat_template *tm, int max_len,
                          pd_api_prompts *p, pd_api_error *e) {
    pd_api_request r;
    pd_status st = parse(k, body, &r, e);
    if (st) return st;
    st = pd_api_request_tokenize(&r, tok, tm, max_len, p, e);
    pd_api_request_fini(&r);
    return st;
}

PD_TEST(tokenize_prompt_shapes) {
    pd_tok *tok = load_tok();
    if (!tok) return;
    int32_t bos = pd_tok_bos_id(tok);
    PD_CHECK_EQ(bos, 4092);
    pd_api_prompts p;
    pd_api_error e;
    // A string: BOS + text, max_tokens filled to the context.
    PD_REQUIRE(tokenize(C, "{\"prompt\":\"In the beginning\"}", tok, NULL, 100, &p, &e) == PD_OK);
    PD_CHECK_EQ(p.n, 1);
    PD_CHECK(p.items[0].n >= 2);
    PD_CHECK_EQ(p.items[0].ids[0], bos);
    PD_CHECK_EQ(p.max_tokens[0], 100 - p.items[0].n);
    int n_text = p.items[0].n;
    pd_api_prompts_fini(&p);
    // Token ids verbatim.
    PD_REQUIRE(tokenize(C, "{\"prompt\":[5,6,7],\"max_tokens\":4}", tok, NULL, 100, &p, &e) == PD_OK);
    PD_CHECK_EQ(p.n, 1);
    PD_CHECK_EQ(p.items[0].n, 3);
    PD_CHECK_EQ(p.items[0].ids[2], 7);
    PD_CHECK_EQ(p.max_tokens[0], 4);
    pd_api_prompts_fini(&p);
    // Batches of strings and of id lists.
    PD_REQUIRE(tokenize(C, "{\"prompt\":[\"In the beginning\",\"And\"],\"n\":2}", tok, NULL, 100, &p, &e) == PD_OK);
    PD_CHECK_EQ(p.n, 2);
    PD_CHECK_EQ(p.items[0].n, n_text);
    PD_CHECK_EQ(p.items[1].ids[0], bos);
    pd_api_prompts_fini(&p);
    PD_REQUIRE(tokenize(C, "{\"prompt\":[[1],[2,3]]}", tok, NULL, 100, &p, &e) == PD_OK);
    PD_CHECK_EQ(p.n, 2);
    PD_CHECK_EQ(p.items[1].n, 2);
    pd_api_prompts_fini(&p);
    pd_tok_free(tok);
}

PD_TEST(tokenize_rejects) {
    pd_tok *tok = load_tok();
    if (!tok) return;
    pd_api_prompts p;
    pd_api_error e;
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[4096]}", tok, NULL, 100, &p, &e), PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "prompt");
    PD_CHECK_CONTAINS(e.message, "out of range");
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[[1],[-3]]}", tok, NULL, 100, &p, &e), PD_ERR_INVALID);
    PD_CHECK_EQ(p.n, 0);
    // Context: prompt alone must leave room; prompt + max_tokens must fit.
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[1,2,3,4,5]}", tok, NULL, 5, &p, &e), PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "prompt");
    PD_CHECK_CONTAINS(e.message, "maximum context length is 5 tokens");
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[1,2,3],\"max_tokens\":3}", tok, NULL, 5, &p, &e), PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "prompt");
    PD_CHECK_CONTAINS(e.message, "you requested 6 tokens (3 in the prompt, 3 in the completion)");
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[1],\"max_tokens\":5}", tok, NULL, 5, &p, &e), PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "max_tokens");  // oversized on its own
    PD_CHECK_EQ(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":9}", tok, NULL, 5, &p,
                         &e),
                PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "max_completion_tokens");
    PD_CHECK_EQ(tokenize(C, "{\"prompt\":[1,2,3],\"max_tokens\":2}", tok, NULL, 5, &p, &e), PD_OK);
    pd_api_prompts_fini(&p);
    PD_CHECK_EQ(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", tok, NULL, 100, &p, &e),
                PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "messages");
    PD_CHECK_CONTAINS(e.message, "no chat template");
    // Invalid UTF-8 never gets this far: jansson rejects it while parsing the body.
    PD_CHECK_EQ(parse(C, "{\"prompt\":\"\xff\"}", &(pd_api_request){0}, &e), PD_ERR_INVALID);
    pd_tok_free(tok);
}

PD_TEST(tokenize_chat_template) {
    pd_tok *tok = load_tok();
    if (!tok) return;
    const char *chatml = pd_tok_chat_template(tok);
    PD_REQUIRE(chatml != NULL);
    pd_chat_template *tm = tmpl_of(chatml);
    pd_api_prompts p;
    pd_api_error e;
    PD_REQUIRE(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"In the beginning\"}]}", tok, tm, 2048, &p,
                        &e) == PD_OK);
    // ChatML writes no BOS, so encode adds it; the text ends with the generation prompt.
    pd_tok_ids want = {0};
    const char *text = "<|im_start|>user\nIn the beginning<|im_end|>\n<|im_start|>assistant\n";
    PD_CHECK_EQ(pd_tok_encode(tok, text, strlen(text), true, true, &want), PD_OK);
    PD_CHECK_EQ(p.items[0].n, want.n);
    PD_CHECK(p.items[0].n == want.n && !memcmp(p.items[0].ids, want.ids, sizeof(int32_t) * (size_t)want.n));
    PD_CHECK_EQ(p.items[0].ids[1], 4094);  // <|im_start|> matched as a special token
    pd_tok_ids_free(&want);
    pd_api_prompts_fini(&p);
    pd_chat_template_free(tm);
    // A template that writes BOS itself: exactly one BOS.
    tm = tmpl_of("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
    PD_REQUIRE(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"And\"}]}", tok, tm, 2048, &p, &e) ==
               PD_OK);
    PD_CHECK_EQ(p.items[0].ids[0], 4092);
    PD_CHECK(p.items[0].n >= 2 && p.items[0].ids[1] != 4092);
    pd_api_prompts_fini(&p);
    pd_chat_template_free(tm);
    // A template that raises: 400 naming messages, with the template's message.
    tm = tmpl_of("{{ raise_exception('roles must alternate') }}");
    PD_CHECK_EQ(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", tok, tm, 2048, &p, &e),
                PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "messages");
    PD_CHECK_CONTAINS(e.message, "roles must alternate");
    pd_chat_template_free(tm);
    // tools and chat_template_kwargs reach the template; wrong types are 400s naming them.
    tm = tmpl_of("{% if tools %}{{ tools[0].function.name }}:{% endif %}{{ greeting }}");
    PD_REQUIRE(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                            "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"Amen\"}}],"
                            "\"chat_template_kwargs\":{\"greeting\":\" selah\"},\"add_special_tokens\":false}",
                        tok, tm, 2048, &p, &e) == PD_OK);
    pd_tok_ids want2 = {0};
    PD_CHECK_EQ(pd_tok_encode(tok, "Amen: selah", 11, false, true, &want2), PD_OK);
    PD_CHECK(p.items[0].n == want2.n && !memcmp(p.items[0].ids, want2.ids, sizeof(int32_t) * (size_t)want2.n));
    pd_tok_ids_free(&want2);
    pd_api_prompts_fini(&p);
    PD_CHECK_EQ(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", tok, tm, 2048, &p, &e),
                PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "tools");
    PD_CHECK_EQ(tokenize(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":[]}", tok, tm,
                         2048, &p, &e),
                PD_ERR_INVALID);
    PD_CHECK_STR(e.param, "chat_template_kwargs");
    pd_chat_template_free(tm);
    pd_tok_free(tok);
}

// Tool turns through every fixture template: the model's own tool syntax where the template has
// one (tools rendered, assistant tool_calls with object arguments, tool results), our Hermes
// system prompt where it has none. The rendered prompt names the function and carries the result.
PD_TEST(tool_turns_render_in_every_template) {
    pd_tok *tok = load_tok();
    if (!tok) return;
    static const char *files[] = {"qwen25.jinja", "mistral_v03.jinja", "llama31.jinja", "llama32.jinja", "qwen2.jinja",
                                  "llama3.jinja"};
    const char *body =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Weather in Rome?\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"abcdefghi\",\"type\":\"function\","
        "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Rome\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"abcdefghi\",\"content\":\"sunny-and-warm\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\","
        "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]}";
    for (size_t i = 0; i < PD_ARRAY_LEN(files); i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/tests/data/chat/%s", pd_test_repo_dir(), files[i]);
        FILE *f = fopen(path, "rb");
        PD_REQUIRE(f);
        char *src = pd_calloc(1, 1 << 16);
        size_t n = fread(src, 1, (1 << 16) - 1, f);
        fclose(f);
        pd_chat_template *tm = tmpl_of(src);
        pd_api_request r;
        pd_api_error e;
        pd_api_prompts p = {0};
        PD_REQUIRE(parse(CH, body, &r, &e) == PD_OK);
        r.tool_format = pd_api_tool_format_detect(src);
        pd_status st = pd_api_request_tokenize(&r, tok, tm, 8192, &p, &e);
        PD_CHECK_MSG(st == PD_OK, "%s: %s", files[i], e.message);
        if (st == PD_OK) {
            char *text = NULL;
            size_t len = 0;
            PD_CHECK(pd_tok_decode(tok, p.items[0].ids, p.items[0].n, false, &text, &len) == PD_OK);
            PD_CHECK_MSG(text && strstr(text, "get_weather") && strstr(text, "sunny-and-warm"), "%s: %s", files[i],
                         text ? text : "");
            if (r.tool_format == PD_API_TOOLS_FALLBACK) PD_CHECK_MSG(text && strstr(text, "<tools>"), "%s", files[i]);
            pd_free(text);
        }
        (void)n;
        pd_api_prompts_fini(&p);
        pd_api_request_fini(&r);
        pd_chat_template_free(tm);
        pd_free(src);
    }
    pd_tok_free(tok);
}

// The grammar of a forced tool choice, per format: random walks through its token masks (the
// kjv vocabulary) always parse back into calls of the right function with arguments that match
// the parameter schema.
PD_TEST(forced_tool_grammar_parses_back) {
    pd_tok *tok = load_tok();
    if (!tok) return;
    pd_err err = {0};
    pd_grammar_vocab *v = pd_grammar_vocab_new(tok, &err);
    PD_REQUIRE(v);
    const char *body =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\",\"tools\":["
        "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":8},\"days\":{\"type\":\"integer\",\"minimum\":1,"
        "\"maximum\":7}},\"required\":[\"city\",\"days\"],\"additionalProperties\":false}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]}";
    pd_api_tool_format fmts[] = {PD_API_TOOLS_FALLBACK, PD_API_TOOLS_HERMES, PD_API_TOOLS_MISTRAL, PD_API_TOOLS_LLAMA3};
    int32_t eos = pd_tok_eos_id(tok);
    uint32_t *mask = pd_malloc(sizeof(uint32_t) * (size_t)pd_grammar_mask_words(v));
    for (size_t f = 0; f < PD_ARRAY_LEN(fmts); f++) {
        pd_api_request r;
        pd_api_error e;
        PD_REQUIRE(parse(CH, body, &r, &e) == PD_OK);
        char *gbnf = NULL;
        PD_REQUIRE(pd_api_tools_gbnf(&r, fmts[f], &gbnf, &err) == PD_OK);
        pd_grammar *g = pd_grammar_new(gbnf, strlen(gbnf), v, &err);
        PD_CHECK_MSG(g, "format %d: %s", (int)fmts[f], err.msg);
        pd_rng rng;
        pd_rng_seed(&rng, 11 + f);
        int parsed = 0;
        for (int walk = 0; g && walk < 8; walk++) {
            pd_grammar_matcher *m = pd_grammar_matcher_new(g, &eos, 1);
            char text[4096];
            size_t len = 0;
            bool ended = false;
            for (int step = 0; step < 300 && !ended; step++) {
                int n = pd_grammar_matcher_fill_mask(m, mask);
                if (n <= 0) break;
                int32_t pick = -1;
                if ((mask[eos >> 5] >> (eos & 31)) & 1) pick = eos;  // end as soon as allowed
                for (int k = (int)(pd_rng_next(&rng) % (uint64_t)n); pick < 0;)
                    for (int32_t t = 0; t < pd_grammar_vocab_size(v) && pick < 0; t++)
                        if ((mask[t >> 5] >> (t & 31)) & 1 && k-- == 0) pick = t;
                PD_REQUIRE(pd_grammar_matcher_accept(m, pick) == PD_OK);
                if (pick == eos) {
                    ended = true;
                    break;
                }
                size_t bn = 0;
                const char *b = pd_tok_token_bytes(tok, pick, &bn);
                if (len + bn >= sizeof text) break;
                memcpy(text + len, b, bn);
                len += bn;
            }
            pd_grammar_matcher_free(m);
            if (!ended) continue;
            size_t clen = 1;
            json_t *calls = pd_api_tools_parse(text, len, fmts[f], r.tools, &rng, &clen);
            PD_CHECK_MSG(json_array_size(calls) >= 1 && clen == 0, "format %d: %.*s", (int)fmts[f], (int)len, text);
            size_t i;
            json_t *c;
            json_array_foreach(calls, i, c) {
                json_t *fn = json_object_get(c, "function");
                const char *name = json_string_value(json_object_get(fn, "name"));
                json_t *args = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
                PD_CHECK(json_is_object(args));
                if (name && !strcmp(name, "get_weather")) {
                    json_int_t d = json_integer_value(json_object_get(args, "days"));
                    PD_CHECK(json_is_string(json_object_get(args, "city")) && d >= 1 && d <= 7);
                } else {
                    PD_CHECK(name && !strcmp(name, "now"));
                }
                json_decref(args);
            }
            parsed += calls != NULL;
            json_decref(calls);
        }
        PD_CHECK_MSG(parsed > 0, "format %d: no walk ended", (int)fmts[f]);
        pd_grammar_unref(g);
        pd_free(gbnf);
        pd_api_request_fini(&r);
    }
    pd_free(mask);
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
}
