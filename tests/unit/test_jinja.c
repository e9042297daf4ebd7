// test_jinja — the Jinja engine (src/tok/jinja*.c).
//
// Two kinds of checks:
//   * features: every snippet of tests/data/chat/features.json (whitespace control, literals,
//     operators, statements, filters, tests, methods, errors) rendered by real jinja2 through
//     tools/fixtures/gen_chat_fixtures.py must render byte for byte the same here, or fail where
//     jinja2 failed (with the same message when the template raised).
//   * hand-written cases for what a fixture cannot show: error positions, limits, thread safety,
//     namespaces that would form cycles, API edge cases.
#include <pthread.h>

#include "test.h"
#include "tok/chat.h"
#include "tok/jinja.h"

static char *render_str(const char *src, const char *ctx_json, pd_err *err) {
    pd_jinja_tmpl *t = pd_jinja_parse(src, strlen(src), err);
    if (!t) return NULL;
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : NULL;
    char *out = NULL;
    pd_jinja_render(t, ctx, &out, NULL, err);
    json_decref(ctx);
    pd_jinja_free(t);
    return out;
}

// Renders src and checks the output equals want.
#define CHECK_RENDER(src, ctx, want)                                      \
    do {                                                                  \
        pd_err e_ = {0};                                                  \
        char *o_ = render_str(src, ctx, &e_);                             \
        PD_CHECK_MSG(o_ != NULL, "render of %s failed: %s", src, e_.msg); \
        if (o_) PD_CHECK_STR(o_, want);                                   \
        pd_free(o_);                                                      \
    } while (0)

// Renders src and checks it fails with a message containing want.
#define CHECK_FAILS(src, ctx, want)                                       \
    do {                                                                  \
        pd_err e_ = {0};                                                  \
        char *o_ = render_str(src, ctx, &e_);                             \
        PD_CHECK_MSG(o_ == NULL, "%s should fail, gave \"%s\"", src, o_); \
        PD_CHECK_CONTAINS(e_.msg, want);                                  \
        PD_CHECK_EQ(e_.status, PD_ERR_INVALID);                           \
        pd_free(o_);                                                      \
    } while (0)

static json_t *load_repo_json(const char *rel) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", pd_test_repo_dir(), rel);
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j) fprintf(stderr, "  cannot load %s: %s\n", path, jerr.text);
    return j;
}

PD_TEST(test_features_match_jinja2) {
    json_t *fx = load_repo_json("tests/data/chat/features.json");
    PD_REQUIRE(fx);
    json_t *ctx = json_object_get(fx, "context"), *cases = json_object_get(fx, "cases");
    pd_jinja_limits lim = pd_jinja_limits_default();
    lim.now_unix = json_integer_value(json_object_get(fx, "now_unix"));
    PD_CHECK(json_array_size(cases) > 100);
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *src = json_string_value(json_object_get(c, "template"));
        json_t *want = json_object_get(c, "text"), *want_err = json_object_get(c, "error");
        pd_err err = {0};
        char *out = NULL;
        size_t out_len = 0;
        pd_jinja_tmpl *t = pd_jinja_parse(src, strlen(src), &err);
        if (t) pd_jinja_render_ex(t, ctx, &lim, &out, &out_len, &err);
        pd_jinja_free(t);
        if (want) {
            PD_CHECK_MSG(out && out_len == json_string_length(want) &&
                             !memcmp(out, json_string_value(want), out_len),
                         "%s: got \"%s\" (%s), want \"%s\"", name, out ? out : "(null)", err.msg,
                         json_string_value(want));
        } else {
            PD_CHECK_MSG(!out, "%s: should fail like jinja2 (%s), rendered \"%s\"", name,
                         json_string_value(want_err), out);
            PD_CHECK_MSG(err.status == PD_ERR_INVALID, "%s: status %d", name, err.status);
            if (json_is_true(json_object_get(c, "raised")))
                PD_CHECK_MSG(!strcmp(err.msg, json_string_value(want_err)), "%s: message \"%s\", want \"%s\"",
                             name, err.msg, json_string_value(want_err));
        }
        pd_free(out);
    }
    json_decref(fx);
}

PD_TEST(test_whitespace_control) {
    CHECK_RENDER("{% for x in [1, 2] %}\n  {{ x }}\n{% endfor %}\n", NULL, "  1\n  2\n");
    CHECK_RENDER("a\n  {%- if true -%}\n  b\n  {%- endif %}", NULL, "ab");
    CHECK_RENDER("x\n    {% set y = 1 %}\nz", NULL, "x\nz");
    CHECK_RENDER("{{ 'a' }}\n{{ 'b' -}}\n   c", NULL, "a\nbc");
    CHECK_RENDER("line\r\nnext\rlast\n\n", NULL, "line\nnext\nlast\n");
    CHECK_RENDER("\t{% if true %}tab{% endif %}", NULL, "tab");
    CHECK_RENDER("{{ {'a': {'b': 1}} }}", NULL, "{'a': {'b': 1}}");
}

PD_TEST(test_loop_and_namespace) {
    const char *ctx = "{\"m\": [{\"role\": \"user\"}, {\"role\": \"assistant\"}, {\"role\": \"user\"}]}";
    CHECK_RENDER("{% for x in m %}{{ loop.index }}/{{ loop.length }}{% if not loop.last %},{% endif %}{% endfor %}", ctx,
                 "1/3,2/3,3/3");
    CHECK_RENDER("{% set ns = namespace(n=0) %}{% for x in m if x.role == 'user' %}{% set ns.n = ns.n + loop.index %}"
                 "{% endfor %}{{ ns.n }}", ctx, "3");
    CHECK_RENDER("{% for x in m[::-1] %}{{ x.role[0] }}{% endfor %}", ctx, "uau");
    CHECK_RENDER("{% for x in m %}{% if loop.index0 > 0 %}{{ m[loop.index0 - 1].role }}{% endif %};{% endfor %}", ctx,
                 ";user;assistant;");
}

PD_TEST(test_syntax_error_positions) {
    pd_err err = {0};
    pd_jinja_tmpl *t = pd_jinja_parse("hello\n  {{ 1 + }}", 17, &err);
    PD_CHECK(t == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "line 2:");
    t = pd_jinja_parse("a\nb\n{% for x in y %}", 20, &err);
    PD_CHECK(t == NULL);
    PD_CHECK_CONTAINS(err.msg, "line 3:");
    PD_CHECK_CONTAINS(err.msg, "for");
    t = pd_jinja_parse("{{ x | nosuch }}", 16, &err);
    PD_CHECK(t == NULL);
    PD_CHECK_CONTAINS(err.msg, "line 1:8: No filter named 'nosuch'");
    t = pd_jinja_parse("ok \xff\xfe", 5, &err);
    PD_CHECK(t == NULL);
    PD_CHECK_CONTAINS(err.msg, "UTF-8");
    CHECK_FAILS("{% if x %}{% endfor %}", NULL, "line 1:");
}

PD_TEST(test_runtime_error_lines) {
    CHECK_FAILS("a\nb\n{{ foo.bar }}", NULL, "line 3: 'foo' is undefined");
    CHECK_FAILS("{% for x in [1] %}\n\n{{ x + 'a' }}{% endfor %}", NULL, "line 3:");
    CHECK_FAILS("{{ [1, 2] | tojson }}{{ undefined_thing | tojson }}", NULL, "not JSON serializable");
    CHECK_FAILS("{% set n = namespace() %}{{ n | tojson }}", NULL, "Namespace is not JSON serializable");
}

PD_TEST(test_raise_exception_message_is_verbatim) {
    pd_err err = {0};
    char *out = render_str("{{ raise_exception('Conversation roles must alternate user/assistant') }}", NULL, &err);
    PD_CHECK(out == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK_STR(err.msg, "Conversation roles must alternate user/assistant");
}

PD_TEST(test_undefined_semantics) {
    CHECK_RENDER("[{{ nope }}][{{ nope | length }}][{{ nope is defined }}][{{ nope | default('d') }}]"
                 "[{% for x in nope %}x{% endfor %}][{{ 'a' in nope }}][{{ {'a': 1}.b }}]",
                 NULL, "[][0][False][d][][False][]");
    CHECK_FAILS("{{ nope.attr }}", NULL, "'nope' is undefined");
    CHECK_FAILS("{{ nope[0] }}", NULL, "'nope' is undefined");
    CHECK_FAILS("{{ nope - 1 }}", NULL, "'nope' is undefined");
    CHECK_FAILS("{{ nope() }}", NULL, "'nope' is undefined");
    CHECK_RENDER("{{ none.attr }}|{{ (1).attr }}", NULL, "|");
}

PD_TEST(test_limits) {
    pd_jinja_limits lim = pd_jinja_limits_default();
    pd_err err = {0};
    char *out = NULL;
    struct { const char *src; const char *want; pd_jinja_limits lim; } cases[] = {
        {"{{ 'x' * 100 }}", "limit", lim},
        {"{% for i in range(100) %}{{ 'abcdefghij' }}{% endfor %}", "limit", lim},
        {"{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", "steps", lim},
        {"{{ range(100000000) | length }}", "limit", lim},
        {"{{ ([1] * 100000000) | length }}", "limit", lim},
        {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested deeper", lim},
        {"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "limit", lim},
    };
    cases[0].lim.max_output_bytes = 50;
    cases[1].lim.max_output_bytes = 500;
    cases[2].lim.max_steps = 100000;
    for (size_t k = 0; k < PD_ARRAY_LEN(cases); k++) {
        pd_jinja_tmpl *t = pd_jinja_parse(cases[k].src, strlen(cases[k].src), &err);
        PD_REQUIRE(t);
        int64_t t0 = pd_time_us();
        pd_status st = pd_jinja_render_ex(t, NULL, &cases[k].lim, &out, NULL, &err);
        PD_CHECK_MSG(st == PD_ERR_INVALID, "case %zu: status %d", k, st);
        PD_CHECK_CONTAINS(err.msg, cases[k].want);
        PD_CHECK_MSG(pd_time_us() - t0 < 5000000, "case %zu took too long", k);
        PD_CHECK(out == NULL);
        pd_jinja_free(t);
    }
    // Deep nesting is a syntax error, not a stack overflow.
    char deep[4096];
    size_t n = 0;
    memcpy(deep, "{{ ", 3);
    n = 3;
    for (int k = 0; k < 1000; k++) deep[n++] = '(';
    memcpy(deep + n, "1", 2);
    pd_jinja_tmpl *t = pd_jinja_parse(deep, strlen(deep), &err);
    PD_CHECK(t == NULL);
    PD_CHECK_CONTAINS(err.msg, "nested too deeply");
    // A deeply nested value (from a request) fails cleanly when printed.
    json_t *v = json_array();
    for (int k = 0; k < 1000; k++) {
        json_t *outer = json_array();
        json_array_append_new(outer, v);
        v = outer;
    }
    json_t *ctx = json_pack("{so}", "v", v);
    t = pd_jinja_parse("{{ v }}", 7, &err);
    PD_REQUIRE(t);
    PD_CHECK_EQ(pd_jinja_render(t, ctx, &out, NULL, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "nested deeper");
    pd_jinja_free(t);
    json_decref(ctx);
}

PD_TEST(test_namespace_self_reference_is_a_copy) {
    // Storing a namespace in itself stores a snapshot, so no reference cycle (and no leak).
    CHECK_RENDER("{% set ns = namespace(x=1) %}{% set ns.self = ns %}{% set ns.x = 2 %}{{ ns.self.x }}{{ ns.x }}"
                 "{% set ns.l = [ns, ns] %}{{ ns.l | length }}",
                 NULL, "122");
}

PD_TEST(test_context_and_api_edges) {
    pd_err err = {0};
    char *out = NULL;
    size_t len = 99;
    pd_jinja_tmpl *t = pd_jinja_parse("", 0, &err);
    PD_REQUIRE(t);
    PD_CHECK_EQ(pd_jinja_render(t, NULL, &out, &len, &err), PD_OK);
    PD_CHECK_STR(out, "");
    PD_CHECK_EQ(len, 0);
    pd_free(out);
    json_t *bad = json_array();
    PD_CHECK_EQ(pd_jinja_render(t, bad, &out, NULL, &err), PD_ERR_INVALID);
    json_decref(bad);
    pd_jinja_free(t);
    pd_jinja_free(NULL);
    // Embedded NUL survives (lengths, not strlen, all the way).
    static const char nul_src[] = "a\0b{{ 'c\\x00d' }}";
    t = pd_jinja_parse(nul_src, sizeof nul_src - 1, &err);
    PD_REQUIRE(t);
    PD_CHECK_EQ(pd_jinja_render(t, NULL, &out, &len, &err), PD_OK);
    PD_CHECK_EQ(len, 6);
    PD_CHECK(!memcmp(out, "a\0bc\0d", 6));
    pd_free(out);
    pd_jinja_free(t);
}

PD_TEST(test_chat_apply) {
    const char *chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
                         "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"Hi \\u00e9\"}]", 0, NULL);
    pd_err err = {0};
    char *out = NULL;
    PD_CHECK_EQ(pd_chat_apply(chatml, msgs, true, "<s>", "</s>", NULL, &out, &err), PD_OK);
    PD_CHECK_STR(out, "<|im_start|>user\nHi \xc3\xa9<|im_end|>\n<|im_start|>assistant\n");
    pd_free(out);
    // Context: tools/documents are defined and none, tokens are there, kwargs override.
    const char *probe = "{{ tools is defined }},{{ tools is none }},{{ documents }},{{ bos_token }}{{ eos_token }},{{ x }}";
    json_t *kw = json_pack("{sisssi}", "x", 5, "eos_token", "EOS", "unused", 1);
    PD_CHECK_EQ(pd_chat_apply(probe, msgs, false, "<s>", "</s>", kw, &out, &err), PD_OK);
    PD_CHECK_STR(out, "True,True,None,<s>EOS,5");
    pd_free(out);
    // Messages must be an array; syntax errors come back as such.
    PD_CHECK_EQ(pd_chat_apply(chatml, kw, true, NULL, NULL, NULL, &out, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_chat_apply("{% if %}", msgs, true, NULL, NULL, NULL, &out, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "line 1:");
    PD_CHECK_EQ(pd_chat_apply("{{ raise_exception('nope') }}", msgs, true, NULL, NULL, NULL, &out, &err),
                PD_ERR_INVALID);
    PD_CHECK_STR(err.msg, "nope");
    json_decref(kw);
    json_decref(msgs);
}

typedef struct {
    const pd_jinja_tmpl *t;
    json_t *ctx;
    const char *want;
    int n_bad;
} thread_arg;

static void *render_many(void *p) {
    thread_arg *a = p;
    for (int k = 0; k < 200; k++) {
        char *out = NULL;
        pd_err err = {0};
        if (pd_jinja_render(a->t, a->ctx, &out, NULL, &err) != PD_OK || strcmp(out, a->want)) a->n_bad++;
        pd_free(out);
    }
    return NULL;
}

PD_TEST(test_concurrent_renders) {
    const char *src = "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content | upper %}"
                      "{{ m.role }}:{{ m.content | tojson }};{% endfor %}{{ ns.s }}";
    json_t *ctx = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"ab\"}, "
                             "{\"role\": \"assistant\", \"content\": \"c\\u00e9\"}]}", 0, NULL);
    pd_err err = {0};
    pd_jinja_tmpl *t = pd_jinja_parse(src, strlen(src), &err);
    PD_REQUIRE(t);
    const char *want = "user:\"ab\";assistant:\"c\xc3\xa9\";ABC\xc3\x89";
    pthread_t th[4];
    thread_arg args[4];
    // Threads 0-1 share one context (jansson's reference counts are atomic); threads 2-3 have
    // their own, as requests do. All share the template, whose reference counts are never touched.
    json_t *own[2] = {json_deep_copy(ctx), json_deep_copy(ctx)};
    for (int k = 0; k < 4; k++) {
        args[k] = (thread_arg){t, k < 2 ? ctx : own[k - 2], want, 0};
        pthread_create(&th[k], NULL, render_many, &args[k]);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
        PD_CHECK_EQ(args[k].n_bad, 0);
    }
    json_decref(own[0]);
    json_decref(own[1]);
    pd_jinja_free(t);
    json_decref(ctx);
}

PD_TEST(test_allocation_failures_are_clean) {
    // Every allocation site of parse + render may fail: the result is an error, never a crash or
    // a leak (the harness checks pd_malloc balance after the test).
    const char *src = "{% set ns = namespace(a=[]) %}{% for m in messages %}{% set ns.a = ns.a + [m.role] %}"
                      "{{ m.content | trim | upper }}{% endfor %}{{ ns.a | join(',') }}{{ messages | tojson(indent=2) }}";
    json_t *ctx = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \" x \"}]}", 0, NULL);
    int n_ok = 0;
    for (long k = 0; k < 200; k++) {
        pd_err err = {0};
        char *out = NULL;
        pd_mem_fault_set(k, false);
        pd_jinja_tmpl *t = pd_jinja_parse(src, strlen(src), &err);
        if (t && pd_jinja_render(t, ctx, &out, NULL, &err) == PD_OK) n_ok++;
        pd_mem_fault_set(-1, false);
        pd_free(out);
        pd_jinja_free(t);
    }
    PD_CHECK(n_ok > 0);
    json_decref(ctx);
}
