// test_chat_template — chat templates rendered byte for byte as transformers renders them.
//
//   * golden/chat_template.json (PD_MODELS_DIR): the ChatML template of tokenizer/
//     tokenizer_config.json, rendered by AutoTokenizer.apply_chat_template.
//   * tests/data/chat/<model>.json: real templates (Llama 2/3/3.1/3.2, Mistral v0.1/v0.3,
//     Qwen2/2.5) over conversations with and without system prompts, multi-turn, non-ASCII text,
//     tools and tool calls, and cases where the template raises, rendered by real jinja2 in
//     transformers' environment (tools/fixtures/gen_chat_fixtures.py).
#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"
#include "tok/chat.h"

static json_t *load_json_file(const char *path) {
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j) fprintf(stderr, "  cannot load %s: %s\n", path, jerr.text);
    return j;
}

// Renders every conversation of golden (an object with "conversations") and compares "text".
static void check_golden_conversations(const pd_chat_template *ct, json_t *golden) {
    json_t *convs = json_object_get(golden, "conversations");
    PD_CHECK(json_array_size(convs) >= 3);
    size_t i;
    json_t *c;
    json_array_foreach(convs, i, c) {
        char *out = NULL;
        size_t len = 0;
        pd_err err = {0};
        pd_status st = pd_chat_template_apply(ct, json_object_get(c, "messages"),
                                              json_is_true(json_object_get(c, "add_generation_prompt")),
                                              NULL, NULL, &out, &len, &err);
        json_t *want = json_object_get(c, "text");
        PD_CHECK_MSG(st == PD_OK, "conversation %zu: %s", i, err.msg);
        PD_CHECK_MSG(out && len == json_string_length(want) && !memcmp(out, json_string_value(want), len),
                     "conversation %zu: got \"%s\", want \"%s\"", i, out ? out : "(null)", json_string_value(want));
        pd_free(out);
    }
}

PD_TEST(test_golden_chatml_from_tokenizer_config) {
    char path[1024];
    json_t *cfg = load_json_file(pd_test_path(path, sizeof path, "tokenizer/tokenizer_config.json"));
    json_t *golden = load_json_file(pd_test_path(path, sizeof path, "golden/chat_template.json"));
    PD_REQUIRE(cfg && golden);
    const char *src = NULL;
    pd_err err = {0};
    PD_REQUIRE(pd_chat_template_from_config(cfg, NULL, &src, &err) == PD_OK);
    pd_chat_template *ct = pd_chat_template_new(src, strlen(src), "<|begin_of_text|>", "<|end_of_text|>", &err);
    PD_REQUIRE(ct);
    check_golden_conversations(ct, golden);
    pd_chat_template_free(ct);
    json_decref(cfg);
    json_decref(golden);
}

PD_TEST(test_golden_chatml_from_model_dir) {
    char dir[1024], path[1024];
    pd_err err = {0};
    pd_chat_template *ct = pd_chat_template_load(pd_test_path(dir, sizeof dir, "tokenizer"), &err);
    PD_REQUIRE(ct);
    PD_CHECK_STR(pd_chat_template_bos(ct), "<|begin_of_text|>");
    PD_CHECK_STR(pd_chat_template_eos(ct), "<|end_of_text|>");
    json_t *golden = load_json_file(pd_test_path(path, sizeof path, "golden/chat_template.json"));
    PD_REQUIRE(golden);
    check_golden_conversations(ct, golden);
    json_decref(golden);
    pd_chat_template_free(ct);
    // A folder without any template is "not found", not a crash.
    PD_CHECK(pd_chat_template_load(pd_test_path(dir, sizeof dir, "golden"), &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_NOTFOUND);
}

// Checks one tests/data/chat/<name>.json fixture; returns the number of cases checked.
static size_t check_fixture(const char *dir, const char *fname) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, fname);
    json_t *fx = load_json_file(path);
    if (!fx) {
        PD_CHECK_MSG(false, "cannot load %s", path);
        return 0;
    }
    snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(fx, "template")));
    char *src = NULL;
    size_t src_len = 0;
    pd_err err = {0};
    size_t n_checked = 0;
    if (pd_file_read_all(path, &src, &src_len, &err) != PD_OK) {
        PD_CHECK_MSG(false, "%s", err.msg);
        json_decref(fx);
        return 0;
    }
    pd_chat_template *ct = pd_chat_template_new(src, src_len, json_string_value(json_object_get(fx, "bos_token")),
                                                json_string_value(json_object_get(fx, "eos_token")), &err);
    PD_CHECK_MSG(ct != NULL, "%s: %s", path, err.msg);
    pd_jinja_limits lim = pd_jinja_limits_default();
    lim.now_unix = json_integer_value(json_object_get(fx, "now_unix"));
    size_t i;
    json_t *c;
    json_array_foreach(ct ? json_object_get(fx, "cases") : NULL, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *want = json_object_get(c, "text"), *want_err = json_object_get(c, "error");
        char *out = NULL;
        size_t len = 0;
        pd_status st = pd_chat_template_apply(ct, json_object_get(c, "messages"),
                                              json_is_true(json_object_get(c, "add_generation_prompt")),
                                              json_object_get(c, "kwargs"), &lim, &out, &len, &err);
        if (want) {
            PD_CHECK_MSG(st == PD_OK && len == json_string_length(want) && !memcmp(out, json_string_value(want), len),
                         "%s/%s: got \"%s\" (%s)\n    want \"%s\"", fname, name, out ? out : "(null)",
                         st == PD_OK ? "ok" : err.msg, json_string_value(want));
        } else {
            PD_CHECK_MSG(st == PD_ERR_INVALID && !strcmp(err.msg, json_string_value(want_err)),
                         "%s/%s: status %d \"%s\", want the template's error \"%s\"", fname, name, st,
                         st == PD_OK ? out : err.msg, json_string_value(want_err));
        }
        pd_free(out);
        n_checked++;
    }
    pd_chat_template_free(ct);
    pd_free(src);
    json_decref(fx);
    return n_checked;
}

PD_TEST(test_real_model_templates_match_jinja2) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/data/chat", pd_test_repo_dir());
    DIR *d = opendir(dir);
    PD_REQUIRE(d);
    size_t n_files = 0, n_cases = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t n = strlen(e->d_name);
        if (n < 6 || strcmp(e->d_name + n - 5, ".json") || !strcmp(e->d_name, "features.json")) continue;
        n_cases += check_fixture(dir, e->d_name);
        n_files++;
    }
    closedir(d);
    PD_CHECK_MSG(n_files >= 8, "only %zu template fixtures found in %s", n_files, dir);
    PD_CHECK(n_cases >= 60);
}

PD_TEST(test_template_is_reusable_and_inputs_untouched) {
    // Rendering twice gives the same text and leaves messages and kwargs as they were.
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/chat/llama31.jinja", pd_test_repo_dir());
    char *src = NULL;
    size_t len = 0;
    pd_err err = {0};
    PD_REQUIRE(pd_file_read_all(path, &src, &len, &err) == PD_OK);
    pd_chat_template *ct = pd_chat_template_new(src, len, "<|begin_of_text|>", "<|eot_id|>", &err);
    PD_REQUIRE(ct);
    json_t *msgs = json_loads("[{\"role\": \"system\", \"content\": \" s \"}, {\"role\": \"user\", \"content\": \"u\"}]", 0, NULL);
    json_t *kw = json_loads("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}", 0, NULL);
    char *before_m = json_dumps(msgs, JSON_COMPACT), *before_k = json_dumps(kw, JSON_COMPACT);
    char *a = NULL, *b = NULL;
    PD_CHECK_EQ(pd_chat_template_apply(ct, msgs, true, kw, NULL, &a, NULL, &err), PD_OK);
    PD_CHECK_EQ(pd_chat_template_apply(ct, msgs, true, kw, NULL, &b, NULL, &err), PD_OK);
    PD_CHECK(a && b && !strcmp(a, b));
    PD_CHECK_CONTAINS(a, "Environment: ipython");
    char *after_m = json_dumps(msgs, JSON_COMPACT), *after_k = json_dumps(kw, JSON_COMPACT);
    PD_CHECK_STR(after_m, before_m);
    PD_CHECK_STR(after_k, before_k);
    free(before_m);
    free(before_k);
    free(after_m);
    free(after_k);
    pd_free(a);
    pd_free(b);
    json_decref(msgs);
    json_decref(kw);
    pd_chat_template_free(ct);
    pd_free(src);
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static char *apply_one(const pd_chat_template *ct) {
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"hi\"}]", 0, NULL);
    char *out = NULL;
    pd_err err = {0};
    pd_chat_template_apply(ct, msgs, true, NULL, NULL, &out, NULL, &err);
    json_decref(msgs);
    return out;
}

PD_TEST(test_load_finds_template_and_tokens) {
    char dir[] = "/tmp/pd_chat_test_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_err err = {0};
    // tokenizer_config.json with a list of named templates; tokens as {"content": ...} objects.
    write_file(dir, "tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<B>\", \"lstrip\": false}, \"chat_template\": ["
               "{\"name\": \"tool_use\", \"template\": \"tools\"}, "
               "{\"name\": \"default\", \"template\": \"{{ bos_token }}{{ messages[0].content }}{{ eos_token }}\"}]}");
    write_file(dir, "special_tokens_map.json", "{\"bos_token\": \"<ignored>\", \"eos_token\": \"<E>\"}");
    pd_chat_template *ct = pd_chat_template_load(dir, &err);
    PD_REQUIRE(ct);
    char *out = apply_one(ct);
    PD_CHECK_STR(out, "<B>hi<E>");
    pd_free(out);
    pd_chat_template_free(ct);
    // chat_template.jinja wins over tokenizer_config.json.
    write_file(dir, "chat_template.jinja", "[{{ messages | length }}]\n");
    ct = pd_chat_template_load(dir, &err);
    PD_REQUIRE(ct);
    out = apply_one(ct);
    PD_CHECK_STR(out, "[1]");
    pd_free(out);
    pd_chat_template_free(ct);
    // A syntax error is reported with its position.
    write_file(dir, "chat_template.jinja", "ok\n{% for %}");
    PD_CHECK(pd_chat_template_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "line 2:");
    char path[1024];
    const char *names[] = {"chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json"};
    for (size_t k = 0; k < PD_ARRAY_LEN(names); k++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        remove(path);
    }
    rmdir(dir);
}
