// test_grammar.c — the grammar module: GBNF compile errors, byte-level recognition (UTF-8 classes,
// repetition, nesting), token masks checked token by token against the recognizer's definition
// (a token is allowed iff its bytes can be accepted now; end tokens iff the state accepts) on the
// real kjv-llama-6m and Qwen2 vocabularies, JSON-schema compilation (random walks through the
// mask always end in JSON that parses and satisfies the schema), and the refused keywords.
//
// PD_GRAMMAR_BENCH=1 prints the mask cost per step on the Qwen2 vocabulary (151k tokens); it is
// reported, never asserted.
#include "test.h"

#include <jansson.h>
#include <time.h>

#include "grammar/grammar.h"
#include "tok/tok.h"

static pd_grammar_vocab *load_vocab(const char *model, pd_tok **tok_out) {
    char path[512];
    pd_err err = {0};
    pd_tok *tok = pd_tok_load(pd_test_path(path, sizeof path, model), &err);
    if (!tok) {
        fprintf(stderr, "  cannot load %s: %s\n", model, err.msg);
        return NULL;
    }
    pd_grammar_vocab *v = pd_grammar_vocab_new(tok, &err);
    *tok_out = tok;
    return v;
}

static pd_grammar *compile(const char *text, const pd_grammar_vocab *v, pd_err *err) {
    return pd_grammar_new(text, strlen(text), v, err);
}

static bool accepts(pd_grammar *g, const char *s) {
    pd_grammar_matcher *m = pd_grammar_matcher_new(g, NULL, 0);
    bool ok = m && pd_grammar_matcher_accept_bytes(m, s, strlen(s)) == PD_OK && pd_grammar_matcher_is_accepting(m);
    pd_grammar_matcher_free(m);
    return ok;
}

static bool prefix_ok(pd_grammar *g, const char *s) {
    pd_grammar_matcher *m = pd_grammar_matcher_new(g, NULL, 0);
    bool ok = m && pd_grammar_matcher_accept_bytes(m, s, strlen(s)) == PD_OK;
    pd_grammar_matcher_free(m);
    return ok;
}

PD_TEST(gbnf_errors) {
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"root ::= foo", "undefined rule 'foo'"},
        {"x ::= \"a\"", "no 'root' rule"},
        {"root ::= root \"a\" | \"b\"", "left recursion"},
        {"root ::= a\na ::= \"x\"? root", "left recursion"},
        {"root ::= \"a\" ::=", "line 1"},
        {"root ::= \"abc", "unterminated string"},
        {"root ::= [a-", "unterminated character class"},
        {"root ::= ( \"a\"", "missing ')'"},
        {"root ::= \"a\"{3,1}", "max below min"},
        {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
        {"root ::= * \"a\"", "without anything to repeat"},
        {"root ::= \"\\q\"", "unknown escape"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_err err = {0};
        pd_grammar *g = compile(cases[i].text, NULL, &err);
        PD_CHECK_MSG(!g, "case %zu compiled", i);
        pd_grammar_unref(g);
        PD_CHECK_EQ(err.status, PD_ERR_INVALID);
        PD_CHECK_CONTAINS(err.msg, cases[i].want);
    }
}

PD_TEST(gbnf_recognizes_bytes) {
    pd_err err = {0};
    pd_grammar *g = compile("root ::= \"a\" [0-9]+ \"b\" | \"x\" ( \"y\" | \"z\" )* # comment\n", NULL, &err);
    PD_REQUIRE(g);
    PD_CHECK(accepts(g, "a1b"));
    PD_CHECK(accepts(g, "a123b"));
    PD_CHECK(!accepts(g, "ab"));
    PD_CHECK(!accepts(g, "a1"));
    PD_CHECK(prefix_ok(g, "a1"));
    PD_CHECK(accepts(g, "x"));
    PD_CHECK(accepts(g, "xyzzy"));
    PD_CHECK(!prefix_ok(g, "xa"));
    pd_grammar_unref(g);

    // Code-point classes lower to UTF-8; negation excludes what is listed and nothing else.
    g = compile("root ::= [^a\"] [é-ü] \"ñ\" [\\u4e00-\\u4e01]{1,2} .", NULL, &err);
    PD_REQUIRE(g);
    PD_CHECK(accepts(g, "béñ一丁😀"));
    PD_CHECK(accepts(g, "\xe2\x82\xac" "üñ一x"));   // € is not 'a'
    PD_CHECK(!prefix_ok(g, "a"));
    PD_CHECK(!prefix_ok(g, "bañ"));                 // 'a' is below é
    PD_CHECK(prefix_ok(g, "b\xc3"));                // the first byte of é..ü
    PD_CHECK(!prefix_ok(g, "b\xc3\xa0"));           // à is below é
    pd_grammar_unref(g);

    // Bounded repetition, nesting, and a rule defined after use.
    g = compile("root ::= item{2,3}\nitem ::= \"<\" inner? \">\"\ninner ::= item | [a-z]", NULL, &err);
    PD_REQUIRE(g);
    PD_CHECK(accepts(g, "<><a>"));
    PD_CHECK(accepts(g, "<<<b>>><><>"));
    PD_CHECK(!accepts(g, "<>"));
    PD_CHECK(!prefix_ok(g, "<><><><"));
    pd_grammar_unref(g);
}

// The mask of m equals the recognizer's definition, token by token.
static void check_mask(pd_grammar_matcher *m, const pd_tok *tok, const pd_grammar_vocab *v, const uint32_t *mask,
                       int32_t eos) {
    int V = pd_grammar_vocab_size(v);
    for (int32_t t = 0; t < V; t++) {
        bool got = (mask[t >> 5] >> (t & 31)) & 1;
        bool want;
        if (t == eos) {
            want = pd_grammar_matcher_is_accepting(m);
        } else {
            size_t n = 0;
            const char *b = pd_tok_token_bytes(tok, t, &n);
            want = b && n && !pd_tok_is_special(tok, t) && pd_grammar_matcher_can_accept_bytes(m, b, n);
        }
        if (got != want) {
            PD_FAIL_("token %d (%s): mask %d, recognizer %d", t, pd_tok_token_str(tok, t), got, want);
            return;
        }
    }
}

// Walks the mask with a seeded choice among the allowed tokens until an end token; returns the
// text (pd_malloc'd) or NULL if the walk did not end within max_steps.
static char *walk(pd_grammar *g, const pd_tok *tok, const pd_grammar_vocab *v, uint64_t seed, int max_steps,
                  bool check) {
    int32_t eos = pd_tok_eos_id(tok);
    pd_grammar_matcher *m = pd_grammar_matcher_new(g, &eos, 1);
    uint32_t *mask = pd_malloc(sizeof(uint32_t) * (size_t)pd_grammar_mask_words(v));
    char *text = pd_calloc(1, 1);
    size_t len = 0;
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    int V = pd_grammar_vocab_size(v);
    bool ended = false;
    for (int step = 0; step < max_steps && m && mask && text; step++) {
        int n = pd_grammar_matcher_fill_mask(m, mask);
        if (check) check_mask(m, tok, v, mask, eos);
        if (n <= 0) break;
        // Prefer ending soon: once an end token is allowed, take it half the time.
        int32_t pick = -1;
        if ((mask[eos >> 5] >> (eos & 31) & 1) && (pd_rng_next(&rng) & 1)) pick = eos;
        for (int k = (int)(pd_rng_next(&rng) % (uint64_t)n); pick < 0; ) {
            for (int32_t t = 0; t < V; t++)
                if ((mask[t >> 5] >> (t & 31)) & 1 && k-- == 0) {
                    pick = t;
                    break;
                }
        }
        if (pd_grammar_matcher_accept(m, pick) != PD_OK) {
            PD_FAIL_("accept of an allowed token %d failed", pick);
            break;
        }
        if (pick == eos) {
            ended = true;
            break;
        }
        size_t bn = 0;
        const char *b = pd_tok_token_bytes(tok, pick, &bn);
        char *nt = pd_realloc(text, len + bn + 1);
        if (!nt) break;
        text = nt;
        memcpy(text + len, b, bn);
        len += bn;
        text[len] = 0;
    }
    pd_grammar_matcher_free(m);
    pd_free(mask);
    if (!ended) {
        pd_free(text);
        return NULL;
    }
    return text;
}

PD_TEST(mask_matches_recognizer_kjv) {
    pd_tok *tok = NULL;
    pd_grammar_vocab *v = load_vocab("kjv-llama-6m", &tok);
    PD_REQUIRE(v);
    pd_err err = {0};
    const char *gbnf = pd_grammar_json_gbnf();
    pd_grammar *g = compile(gbnf, v, &err);
    PD_REQUIRE(g);
    int ended = 0;
    for (uint64_t seed = 1; seed <= 6; seed++) {
        char *text = walk(g, tok, v, seed, 60, true);
        if (!text) continue;
        ended++;
        json_error_t je;
        json_t *j = json_loads(text, 0, &je);
        PD_CHECK_MSG(json_is_object(j), "not a JSON object: %s (%s)", text, je.text);
        json_decref(j);
        pd_free(text);
    }
    pd_grammar_unref(g);
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
    PD_CHECK(ended >= 0);
}

static const char *k_schema =
    "{\"type\":\"object\",\"additionalProperties\":false,\"required\":[\"name\",\"age\",\"kind\",\"tags\",\"when\"],"
    "\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":6},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},"
    "\"kind\":{\"enum\":[\"a\",\"b\",3,null]},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/tag\"},\"minItems\":1,\"maxItems\":2},"
    "\"when\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"opt\":{\"anyOf\":[{\"type\":\"boolean\"},{\"type\":\"null\"}]},"
    "\"id\":{\"type\":\"string\",\"format\":\"uuid\"}},"
    "\"$defs\":{\"tag\":{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"x\"},\"v\":{\"type\":[\"number\",\"null\"]}},"
    "\"required\":[\"k\"],\"additionalProperties\":false}}}";

static size_t n_chars(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xc0) != 0x80;
    return n;
}

static void check_instance(const char *text) {
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    PD_CHECK_MSG(json_is_object(j), "not JSON: %s (%s)", text, je.text);
    if (!j) return;
    json_t *name = json_object_get(j, "name"), *age = json_object_get(j, "age"), *kind = json_object_get(j, "kind");
    json_t *tags = json_object_get(j, "tags"), *when = json_object_get(j, "when");
    PD_CHECK_MSG(json_is_string(name) && n_chars(json_string_value(name)) <= 6, "name in %s", text);
    PD_CHECK(json_is_integer(age) && json_integer_value(age) >= 0 && json_integer_value(age) <= 120);
    PD_CHECK(kind && (json_is_null(kind) || (json_is_integer(kind) && json_integer_value(kind) == 3) ||
                      (json_is_string(kind) && strchr("ab", json_string_value(kind)[0]))));
    PD_CHECK(json_is_array(tags) && json_array_size(tags) >= 1 && json_array_size(tags) <= 2);
    size_t i;
    json_t *t;
    json_array_foreach(tags, i, t) {
        PD_CHECK(json_is_object(t) && !strcmp(json_string_value(json_object_get(t, "k")), "x"));
        json_t *v = json_object_get(t, "v");
        PD_CHECK(!v || json_is_number(v) || json_is_null(v));
    }
    PD_CHECK(json_is_string(when) && strlen(json_string_value(when)) == 10);
    json_t *id = json_object_get(j, "id");
    PD_CHECK(!id || (json_is_string(id) && strlen(json_string_value(id)) == 36));
    const char *k;
    json_t *x;
    json_object_foreach(j, k, x) PD_CHECK(strstr("name age kind tags when opt id", k) != NULL);
    json_decref(j);
}

PD_TEST(schema_walks_validate_kjv) {
    pd_tok *tok = NULL;
    pd_grammar_vocab *v = load_vocab("kjv-llama-6m", &tok);
    PD_REQUIRE(v);
    json_t *schema = json_loads(k_schema, 0, NULL);
    PD_REQUIRE(schema);
    char *gbnf = NULL;
    pd_err err = {0};
    PD_REQUIRE(pd_grammar_schema_to_gbnf(schema, &gbnf, &err) == PD_OK);
    pd_grammar *g = compile(gbnf, v, &err);
    PD_CHECK_MSG(g, "%s\n%s", err.msg, gbnf);
    int ended = 0;
    for (uint64_t seed = 1; g && seed <= 40; seed++) {
        char *text = walk(g, tok, v, seed, 400, seed <= 2);
        if (!text) continue;
        ended++;
        check_instance(text);
        pd_free(text);
    }
    PD_CHECK_MSG(ended >= 20, "only %d of 40 walks ended", ended);
    pd_grammar_unref(g);
    pd_free(gbnf);
    json_decref(schema);
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
}

PD_TEST(schema_refuses_what_it_cannot_enforce) {
    static const struct {
        const char *schema, *want;
    } cases[] = {
        {"{\"type\":\"string\",\"pattern\":\"^a+$\"}", "'pattern'"},
        {"{\"type\":\"string\",\"format\":\"ipv6\"}", "format 'ipv6'"},
        {"{\"type\":\"number\",\"minimum\":1.5}", "'minimum'"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"uniqueItems\":true}}}", "/properties/a"},
        {"{\"type\":\"object\",\"patternProperties\":{}}", "'patternProperties'"},
        {"{\"if\":{},\"then\":{}}", "keyword 'if'"},
        {"{\"$ref\":\"#/$defs/none\"}", "does not resolve"},
        {"{\"type\":\"widget\"}", "unknown type 'widget'"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "'b'"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        json_t *s = json_loads(cases[i].schema, 0, NULL);
        char *out = NULL;
        pd_err err = {0};
        PD_CHECK_EQ(pd_grammar_schema_to_gbnf(s, &out, &err), PD_ERR_INVALID);
        PD_CHECK_CONTAINS(err.msg, cases[i].want);
        PD_CHECK(out == NULL);
        json_decref(s);
    }
}

PD_TEST(recursive_schema_and_qwen_vocab) {
    pd_tok *tok = NULL;
    pd_grammar_vocab *v = load_vocab("tiny-random-qwen2", &tok);
    PD_REQUIRE(v);
    json_t *schema = json_loads("{\"$defs\":{\"node\":{\"type\":\"object\",\"additionalProperties\":false,"
                                "\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\",\"maxItems\":2,"
                                "\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}",
                                0, NULL);
    char *gbnf = NULL;
    pd_err err = {0};
    PD_REQUIRE(pd_grammar_schema_to_gbnf(schema, &gbnf, &err) == PD_OK);
    pd_grammar *g = compile(gbnf, v, &err);
    PD_REQUIRE(g);
    // Check the masks of the first steps against the recognizer on a 151k vocabulary.
    char *text = walk(g, tok, v, 7, 3, true);
    pd_free(text);
    int ended = 0;
    for (uint64_t seed = 1; seed <= 10; seed++) {
        text = walk(g, tok, v, seed, 300, false);
        if (!text) continue;
        ended++;
        json_t *j = json_loads(text, 0, NULL);
        PD_CHECK_MSG(json_is_integer(json_object_get(j, "v")), "bad instance %s", text);
        json_decref(j);
        pd_free(text);
    }
    PD_CHECK(ended > 0);
    if (getenv("PD_GRAMMAR_BENCH")) {
        // Mask cost per step inside a JSON string and between values, after the caches are warm.
        pd_grammar_matcher *m = pd_grammar_matcher_new(g, NULL, 0);
        uint32_t *mask = pd_malloc(sizeof(uint32_t) * (size_t)pd_grammar_mask_words(v));
        const char *states[] = {"", "{\"v\":1", "{\"v\":12,\"kids\":[{\"v\":3,\"kids\":[", "{\"v\":0 "};
        for (size_t s = 0; s < PD_ARRAY_LEN(states); s++) {
            pd_grammar_matcher *x = pd_grammar_matcher_new(g, NULL, 0);
            pd_grammar_matcher_accept_bytes(x, states[s], strlen(states[s]));
            pd_grammar_matcher_fill_mask(x, mask);  // warm
            struct timespec t0, t1;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
            int reps = 200, n = 0;
            for (int r = 0; r < reps; r++) n = pd_grammar_matcher_fill_mask(x, mask);
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
            double us = ((double)(t1.tv_sec - t0.tv_sec) * 1e6 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e3) / reps;
            printf("  mask after '%s': %.1f us CPU (%d of %d tokens allowed)\n", states[s], us, n, pd_grammar_vocab_size(v));
            pd_grammar_matcher_free(x);
        }
        pd_free(mask);
        pd_grammar_matcher_free(m);
    }
    pd_grammar_unref(g);
    pd_free(gbnf);
    json_decref(schema);
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
}

// Integer bounds: small spans list every value, wide ones (zod's int() is +-(2^53-1)) keep to
// whole digit counts inside the range; every walk ends in range.
PD_TEST(integer_bounds) {
    pd_tok *tok = NULL;
    pd_grammar_vocab *v = load_vocab("kjv-llama-6m", &tok);
    PD_REQUIRE(v);
    static const struct {
        const char *schema;
        long long lo, hi;
    } cases[] = {
        {"{\"type\":\"integer\",\"minimum\":-9007199254740991,\"maximum\":9007199254740991}", -9007199254740991ll, 9007199254740991ll},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":100000}", 5, 100000},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":0}", 1, 999999999999999ll},
        {"{\"type\":\"integer\",\"minimum\":-20,\"maximum\":-3}", -20, -3},
        {"{\"type\":\"integer\",\"maximum\":-150}", -999999999999999ll, -150},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        json_t *s = json_loads(cases[i].schema, 0, NULL);
        char *gbnf = NULL;
        pd_err err = {0};
        PD_REQUIRE(pd_grammar_schema_to_gbnf(s, &gbnf, &err) == PD_OK);
        pd_grammar *g = compile(gbnf, v, &err);
        PD_CHECK_MSG(g, "%s: %s", cases[i].schema, err.msg);
        for (uint64_t seed = 1; g && seed <= 12; seed++) {
            char *text = walk(g, tok, v, seed, 40, false);
            if (!text) continue;
            long long x = strtoll(text, NULL, 10);
            PD_CHECK_MSG(x >= cases[i].lo && x <= cases[i].hi, "%s: %s", cases[i].schema, text);
            pd_free(text);
        }
        pd_grammar_unref(g);
        pd_free(gbnf);
        json_decref(s);
    }
    pd_grammar_vocab_free(v);
    pd_tok_free(tok);
}
