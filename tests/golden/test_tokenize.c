// test_tokenize.c — the tokenizer against Hugging Face tokenizers' own outputs.
//
//   * shared/models/golden/tokenize.json: 54 cases for the byte-level BPE tokenizer in
//     shared/models/tokenizer (Llama 3 layout): ids, ids with BOS, decode, decode skipping
//     specials; the streaming detokenizer must reproduce decode for every case.
//   * tests/data/tok/bytelevel/expected.json: more cases for the same tokenizer (parse_special
//     off, invalid UTF-8 from partial byte tokens, odd whitespace).
//   * tests/data/tok/spm*/: SentencePiece-style BPE fixtures (Llama 2 legacy normalizer,
//     Metaspace pre-tokenizer, Metaspace split) made by tools/fixtures/gen_spm_fixture.py with
//     tokenizers 0.23.2, including added tokens with lstrip/rstrip/single_word/normalized.
#include <jansson.h>

#include "test.h"
#include "tok/tok.h"

static json_t *load_json_file(const char *path) {
    json_error_t je;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    if (!j) fprintf(stderr, "  cannot read %s: %s (line %d)\n", path, je.text, je.line);
    return j;
}

static bool ids_equal(const pd_tok_ids *got, json_t *want, const char *what, const char *name) {
    bool ok = got->n == (int)json_array_size(want);
    for (int i = 0; ok && i < got->n; i++) ok = got->ids[i] == json_integer_value(json_array_get(want, (size_t)i));
    if (!ok) {
        fprintf(stderr, "  %s %s: got %d ids:", name, what, got->n);
        for (int i = 0; i < got->n && i < 40; i++) fprintf(stderr, " %d", got->ids[i]);
        fprintf(stderr, "\n  want %zu ids:", json_array_size(want));
        for (size_t i = 0; i < json_array_size(want) && i < 40; i++) {
            fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(want, i)));
        }
        fprintf(stderr, "\n");
    }
    return ok;
}

static bool text_equal(const char *got, size_t got_len, json_t *want, const char *what, const char *name) {
    size_t wl = json_string_length(want);
    bool ok = got_len == wl && memcmp(got, json_string_value(want), wl) == 0;
    if (!ok) fprintf(stderr, "  %s %s: got \"%.*s\" (%zu bytes) want \"%s\" (%zu bytes)\n", name, what,
                     (int)got_len, got, got_len, json_string_value(want), wl);
    return ok;
}

static void encode_ids(const pd_tok *t, const char *text, size_t len, bool add_special, bool parse_special,
                       pd_tok_ids *out) {
    out->n = 0;
    pd_status st = pd_tok_encode(t, text, len, add_special, parse_special, out);
    PD_CHECK_EQ(st, PD_OK);
}

// Decodes with pd_tok_decode and with the stream (one id at a time); both must equal want.
static void check_decode(const pd_tok *t, const int32_t *ids, int n, bool skip, json_t *want, const char *name) {
    if (!json_is_string(want)) return;
    char *text = NULL;
    size_t len = 0;
    PD_CHECK_EQ(pd_tok_decode(t, ids, n, skip, &text, &len), PD_OK);
    PD_CHECK_MSG(text && text_equal(text, len, want, skip ? "decode(skip)" : "decode", name), "decode %s", name);
    pd_free(text);

    pd_tok_stream *s = pd_tok_stream_new(t, skip);
    PD_CHECK(s != NULL);
    if (!s) return;
    char *acc = pd_malloc(1);
    size_t acc_len = 0;
    for (int i = 0; i <= n; i++) {
        const char *piece;
        size_t pl;
        pd_status st = i < n ? pd_tok_stream_feed(s, ids[i], &piece, &pl) : pd_tok_stream_finish(s, &piece, &pl);
        PD_CHECK_EQ(st, PD_OK);
        char *na = pd_realloc(acc, acc_len + pl + 1);
        PD_REQUIRE(na != NULL);
        acc = na;
        memcpy(acc + acc_len, piece, pl);
        acc_len += pl;
    }
    PD_CHECK_MSG(text_equal(acc, acc_len, want, skip ? "stream(skip)" : "stream", name), "stream %s", name);
    pd_free(acc);
    pd_tok_stream_free(s);
}

static void json_ids(json_t *arr, pd_tok_ids *out) {
    out->n = 0;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        PD_CHECK_EQ(pd_tok_ids_push(out, (int32_t)json_integer_value(json_array_get(arr, i))), PD_OK);
    }
}

// One "cases" entry: {text, ids, ids_with_special, [ids_no_parse_special], decoded, decoded_skip_special}.
static void check_case(const pd_tok *t, json_t *c) {
    const char *name = json_string_value(json_object_get(c, "name"));
    json_t *text = json_object_get(c, "text"), *ids = json_object_get(c, "ids");
    if (!json_is_string(text) || !json_is_array(ids)) return;  // the generator recorded an error
    const char *s = json_string_value(text);
    size_t len = json_string_length(text);
    pd_tok_ids got = {0}, ref = {0};
    encode_ids(t, s, len, false, true, &got);
    PD_CHECK_MSG(ids_equal(&got, ids, "ids", name), "ids %s", name);
    json_t *ws = json_object_get(c, "ids_with_special");
    encode_ids(t, s, len, true, true, &got);
    if (ws) PD_CHECK_MSG(ids_equal(&got, ws, "ids_with_special", name), "ids_with_special %s", name);
    json_t *np = json_object_get(c, "ids_no_parse_special");
    encode_ids(t, s, len, false, false, &got);
    if (np) PD_CHECK_MSG(ids_equal(&got, np, "ids_no_parse_special", name), "ids_no_parse_special %s", name);
    json_ids(ids, &ref);
    check_decode(t, ref.ids, ref.n, false, json_object_get(c, "decoded"), name);
    check_decode(t, ref.ids, ref.n, true, json_object_get(c, "decoded_skip_special"), name);
    pd_tok_ids_free(&got);
    pd_tok_ids_free(&ref);
}

static void check_expected_file(const pd_tok *t, const char *path, int min_cases) {
    json_t *root = load_json_file(path);
    PD_REQUIRE(root != NULL);
    json_t *cases = json_object_get(root, "cases"), *c;
    size_t i;
    int n = 0;
    json_array_foreach(cases, i, c) {
        check_case(t, c);
        n += json_is_array(json_object_get(c, "ids"));
    }
    PD_CHECK_MSG(n >= min_cases, "%s: only %d cases", path, n);
    json_t *dcs = json_object_get(root, "decode_cases");
    pd_tok_ids ids = {0};
    json_array_foreach(dcs, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_ids(json_object_get(c, "ids"), &ids);
        check_decode(t, ids.ids, ids.n, false, json_object_get(c, "decoded"), name);
        check_decode(t, ids.ids, ids.n, true, json_object_get(c, "decoded_skip_special"), name);
    }
    pd_tok_ids_free(&ids);
    json_decref(root);
}

static pd_tok *load_shared(void) {
    char path[1024];
    pd_err err = {0};
    pd_tok *t = pd_tok_load(pd_test_path(path, sizeof(path), "tokenizer"), &err);
    if (!t) fprintf(stderr, "  load failed: %s\n", err.msg);
    return t;
}

PD_TEST(test_golden_bytelevel_54_cases) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    char path[1024];
    json_t *root = load_json_file(pd_test_path(path, sizeof(path), "golden/tokenize.json"));
    PD_REQUIRE(root != NULL);
    PD_CHECK_EQ(json_array_size(json_object_get(root, "cases")), 54);
    PD_CHECK_EQ(pd_tok_n_vocab(t), json_integer_value(json_object_get(root, "vocab_size")));
    json_t *specials = json_object_get(root, "special_tokens"), *v;
    const char *key;
    json_object_foreach(specials, key, v) {
        PD_CHECK_EQ(pd_tok_token_to_id(t, key, strlen(key)), json_integer_value(v));
        PD_CHECK(pd_tok_is_special(t, (int32_t)json_integer_value(v)));
    }
    json_decref(root);
    check_expected_file(t, path, 54);
    pd_tok_free(t);
}

PD_TEST(test_golden_bytelevel_extra) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    char path[1024];
    snprintf(path, sizeof(path), "%s/tests/data/tok/bytelevel/expected.json", pd_test_repo_dir());
    check_expected_file(t, path, 7);
    pd_tok_free(t);
}

static void check_spm_fixture(const char *name, int min_cases) {
    char dir[1024], path[1100];
    snprintf(dir, sizeof(dir), "%s/tests/data/tok/%s", pd_test_repo_dir(), name);
    pd_err err = {0};
    pd_tok *t = pd_tok_load(dir, &err);
    PD_CHECK_MSG(t != NULL, "load %s: %s", dir, err.msg);
    if (!t) return;
    snprintf(path, sizeof(path), "%s/expected.json", dir);
    check_expected_file(t, path, min_cases);
    pd_tok_free(t);
}

PD_TEST(test_golden_spm_legacy) { check_spm_fixture("spm", 25); }
PD_TEST(test_golden_spm_metaspace) { check_spm_fixture("spm_metaspace", 25); }
PD_TEST(test_golden_spm_metaspace_split) { check_spm_fixture("spm_split", 25); }
