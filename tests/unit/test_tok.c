// test_tok.c — unit tests of the tokenizer module: streaming detokenizer on split UTF-8, the
// stop-string matcher, load errors, accessors, NFC, thread safety, and a timing print for a
// ~100k-token document (printed, not asserted).
//
// Uses the byte-level tokenizer in shared/models/tokenizer and the SentencePiece-style fixture
// in tests/data/tok/spm.
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"
#include "tok/tok.h"
#include "tok/tok_impl.h"

static pd_tok *load_shared(void) {
    char path[1024];
    pd_err err = {0};
    pd_tok *t = pd_tok_load(pd_test_path(path, sizeof(path), "tokenizer"), &err);
    if (!t) fprintf(stderr, "  load failed: %s\n", err.msg);
    return t;
}

static pd_tok *load_spm(void) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/tests/data/tok/spm", pd_test_repo_dir());
    pd_err err = {0};
    pd_tok *t = pd_tok_load(path, &err);
    if (!t) fprintf(stderr, "  load failed: %s\n", err.msg);
    return t;
}

static bool utf8_ok(const char *s, size_t n) { return pd_tok_utf8_valid(s, n); }

// ---- streaming detokenizer ------------------------------------------------------------------

PD_TEST(test_stream_split_utf8_bytelevel) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    // "中" is three byte tokens in this vocabulary: nothing may come out before the third.
    const char *text = "a中文😀b";
    pd_tok_ids ids = {0};
    PD_REQUIRE(pd_tok_encode(t, text, strlen(text), false, true, &ids) == PD_OK);
    PD_CHECK(ids.n >= 8);
    pd_tok_stream *s = pd_tok_stream_new(t, false);
    PD_REQUIRE(s != NULL);
    char acc[64] = {0};
    size_t acc_len = 0;
    int n_empty = 0;
    for (int i = 0; i < ids.n; i++) {
        const char *piece;
        size_t len;
        PD_CHECK_EQ(pd_tok_stream_feed(s, ids.ids[i], &piece, &len), PD_OK);
        PD_CHECK_MSG(utf8_ok(piece, len), "piece %d is not whole UTF-8", i);
        n_empty += len == 0;
        PD_REQUIRE(acc_len + len < sizeof(acc));
        memcpy(acc + acc_len, piece, len);
        acc_len += len;
        PD_CHECK(utf8_ok(acc, acc_len));
    }
    const char *rest;
    size_t rest_len;
    PD_CHECK_EQ(pd_tok_stream_finish(s, &rest, &rest_len), PD_OK);
    PD_CHECK_EQ(rest_len, 0);
    PD_CHECK_EQ(acc_len, strlen(text));
    PD_CHECK(memcmp(acc, text, acc_len) == 0);
    PD_CHECK(n_empty >= 4);  // partial characters were held back

    // Feed the first byte of 中 alone, then finish: HF's lossy decode gives U+FFFD.
    const char *piece;
    size_t len;
    int32_t first_cjk = ids.ids[1];
    PD_CHECK_EQ(pd_tok_stream_feed(s, first_cjk, &piece, &len), PD_OK);
    PD_CHECK_EQ(len, 0);
    PD_CHECK_EQ(pd_tok_stream_finish(s, &piece, &len), PD_OK);
    PD_CHECK_EQ(len, 3);
    PD_CHECK(memcmp(piece, "\xEF\xBF\xBD", 3) == 0);
    // A lone byte followed by ASCII: the U+FFFD comes out as soon as the ASCII arrives.
    int32_t a_id = pd_tok_token_to_id(t, "a", 1);
    PD_CHECK_EQ(pd_tok_stream_feed(s, first_cjk, &piece, &len), PD_OK);
    PD_CHECK_EQ(len, 0);
    PD_CHECK_EQ(pd_tok_stream_feed(s, a_id, &piece, &len), PD_OK);
    PD_CHECK_EQ(len, 4);
    PD_CHECK(memcmp(piece, "\xEF\xBF\xBD" "a", 4) == 0);
    PD_CHECK_EQ(pd_tok_stream_finish(s, &piece, &len), PD_OK);
    PD_CHECK_EQ(len, 0);
    pd_tok_stream_free(s);
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
}

PD_TEST(test_stream_spm_byte_fallback_and_strip) {
    pd_tok *t = load_spm();
    PD_REQUIRE(t != NULL);
    // "你" is not in the fixture vocabulary: it encodes as <0xE4><0xBD><0xA0>.
    const char *text = "Hello 你 world";
    pd_tok_ids ids = {0};
    PD_REQUIRE(pd_tok_encode(t, text, strlen(text), true, true, &ids) == PD_OK);
    PD_CHECK_EQ(ids.ids[0], pd_tok_bos_id(t));
    pd_tok_stream *s = pd_tok_stream_new(t, true);
    PD_REQUIRE(s != NULL);
    char acc[64];
    size_t acc_len = 0;
    for (int i = 0; i <= ids.n; i++) {
        const char *piece;
        size_t len;
        pd_status st = i < ids.n ? pd_tok_stream_feed(s, ids.ids[i], &piece, &len) : pd_tok_stream_finish(s, &piece, &len);
        PD_CHECK_EQ(st, PD_OK);
        PD_CHECK(utf8_ok(piece, len));
        if (i == 1) PD_CHECK_MSG(len == 0 || piece[0] != ' ', "the leading space must be stripped");
        PD_REQUIRE(acc_len + len < sizeof(acc));
        memcpy(acc + acc_len, piece, len);
        acc_len += len;
    }
    PD_CHECK_EQ(acc_len, strlen(text));
    PD_CHECK(memcmp(acc, text, acc_len) == 0);
    char *dec;
    size_t dec_len;
    PD_CHECK_EQ(pd_tok_decode(t, ids.ids, ids.n, true, &dec, &dec_len), PD_OK);
    PD_CHECK_STR(dec, text);
    pd_free(dec);
    pd_tok_stream_free(s);
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
}

// ---- stop strings ------------------------------------------------------------------------------

// Feeds fragments; returns the emitted text (static buffer) and the last result.
static const char *run_stop(pd_tok_stop *m, const char *const *frags, int n, bool finish, pd_tok_stop_result *last) {
    static char out[256];
    size_t len = 0;
    for (int i = 0; i <= n; i++) {
        if (i == n && !finish) break;
        pd_status st = i < n ? pd_tok_stop_feed(m, frags[i], strlen(frags[i]), last) : pd_tok_stop_finish(m, last);
        PD_CHECK_EQ(st, PD_OK);
        if (len + last->len >= sizeof(out)) break;
        memcpy(out + len, last->text, last->len);
        len += last->len;
    }
    out[len] = 0;
    return out;
}

PD_TEST(test_stop_split_across_fragments) {
    const char *stops[] = {"STOP", "\n\n"};
    pd_err err = {0};
    pd_tok_stop *m = pd_tok_stop_new(stops, 2, false, &err);
    PD_REQUIRE(m != NULL);
    pd_tok_stop_result r;
    PD_CHECK_EQ(pd_tok_stop_feed(m, "Hello S", 7, &r), PD_OK);
    PD_CHECK_EQ(r.len, 6);  // "S" could start STOP: held back
    PD_CHECK(memcmp(r.text, "Hello ", 6) == 0);
    PD_CHECK(!r.is_stopped);
    PD_CHECK_EQ(pd_tok_stop_feed(m, "TO", 2, &r), PD_OK);
    PD_CHECK_EQ(r.len, 0);
    PD_CHECK_EQ(pd_tok_stop_feed(m, "P and more", 10, &r), PD_OK);
    PD_CHECK(r.is_stopped);
    PD_CHECK_EQ(r.stop_idx, 0);
    PD_CHECK_EQ(r.stop_pos, 6);
    PD_CHECK_EQ(r.len, 0);
    // Later text is ignored.
    PD_CHECK_EQ(pd_tok_stop_feed(m, "x", 1, &r), PD_OK);
    PD_CHECK(r.is_stopped);
    PD_CHECK_EQ(r.len, 0);
    PD_CHECK_EQ(pd_tok_stop_finish(m, &r), PD_OK);
    PD_CHECK_EQ(r.len, 0);
    pd_tok_stop_free(m);

    // A false start is released as soon as it is ruled out.
    m = pd_tok_stop_new(stops, 2, false, &err);
    PD_REQUIRE(m != NULL);
    const char *frags[] = {"a ST", "ORY\n", "\nrest"};
    PD_CHECK_STR(run_stop(m, frags, 3, true, &r), "a STORY");
    PD_CHECK(r.is_stopped);
    PD_CHECK_EQ(r.stop_idx, 1);
    PD_CHECK_EQ(r.stop_pos, 7);
    pd_tok_stop_free(m);
}

PD_TEST(test_stop_overlapping_prefixes) {
    // "aab" inside "aaab": the held-back suffix must restart correctly.
    const char *stops[] = {"aab"};
    pd_err err = {0};
    pd_tok_stop *m = pd_tok_stop_new(stops, 1, false, &err);
    PD_REQUIRE(m != NULL);
    pd_tok_stop_result r;
    const char *frags[] = {"xa", "a", "a", "b", "zz"};
    PD_CHECK_STR(run_stop(m, frags, 5, false, &r), "xa");
    PD_CHECK(r.is_stopped);
    PD_CHECK_EQ(r.stop_pos, 2);
    pd_tok_stop_free(m);

    // Two stop strings ending at the same place: the longer (earlier start) wins; the one that
    // ends first wins over one that starts first.
    const char *two[] = {"bc", "abc", "cd"};
    m = pd_tok_stop_new(two, 3, false, &err);
    PD_REQUIRE(m != NULL);
    const char *f2[] = {"xab", "cd"};
    PD_CHECK_STR(run_stop(m, f2, 2, false, &r), "x");
    PD_CHECK_EQ(r.stop_idx, 1);
    pd_tok_stop_free(m);
    const char *two2[] = {"abcd", "bc"};
    m = pd_tok_stop_new(two2, 2, false, &err);
    PD_REQUIRE(m != NULL);
    const char *f3[] = {"abcd"};
    PD_CHECK_STR(run_stop(m, f3, 1, false, &r), "a");
    PD_CHECK_EQ(r.stop_idx, 1);
    pd_tok_stop_free(m);
}

PD_TEST(test_stop_release_at_end_and_include) {
    const char *stops[] = {"</answer>"};
    pd_err err = {0};
    pd_tok_stop *m = pd_tok_stop_new(stops, 1, false, &err);
    PD_REQUIRE(m != NULL);
    pd_tok_stop_result r;
    PD_CHECK_EQ(pd_tok_stop_feed(m, "42 </ans", 8, &r), PD_OK);
    PD_CHECK_EQ(r.len, 3);
    PD_CHECK_EQ(pd_tok_stop_finish(m, &r), PD_OK);
    PD_CHECK(!r.is_stopped);
    PD_CHECK_EQ(r.stop_idx, -1);
    PD_CHECK_EQ(r.len, 5);
    PD_CHECK(memcmp(r.text, "</ans", 5) == 0);
    pd_tok_stop_free(m);

    m = pd_tok_stop_new(stops, 1, true, &err);
    PD_REQUIRE(m != NULL);
    const char *frags[] = {"42 </ans", "wer> tail"};
    PD_CHECK_STR(run_stop(m, frags, 2, true, &r), "42 </answer>");
    pd_tok_stop_free(m);

    // UTF-8: a held-back prefix never splits a character.
    const char *u[] = {"é!"};
    m = pd_tok_stop_new(u, 1, false, &err);
    PD_REQUIRE(m != NULL);
    PD_CHECK_EQ(pd_tok_stop_feed(m, "café", strlen("café"), &r), PD_OK);
    PD_CHECK_EQ(r.len, 3);
    PD_CHECK_EQ(pd_tok_stop_feed(m, " ok", 3, &r), PD_OK);
    PD_CHECK_EQ(r.len, 5);
    PD_CHECK(memcmp(r.text, "\xC3\xA9 ok", 5) == 0);
    pd_tok_stop_free(m);

    const char *bad[] = {"x", ""};
    PD_CHECK(pd_tok_stop_new(bad, 2, false, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "empty");
}

// ---- load errors ---------------------------------------------------------------------------------

static void write_file(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    PD_REQUIRE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void remove_dir(const char *dir) {
    const char *names[] = {"tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < PD_ARRAY_LEN(names); i++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

PD_TEST(test_load_errors) {
    pd_err err = {0};
    PD_CHECK(pd_tok_load("/nonexistent/model", &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_NOTFOUND);
    PD_CHECK_CONTAINS(err.msg, "/nonexistent/model/tokenizer.json");
    PD_CHECK_CONTAINS(err.msg, "No such file");

    char dir[] = "/tmp/pd_tok_test_XXXXXX";
    PD_REQUIRE(mkdtemp(dir) != NULL);
    write_file(dir, "tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,}}");
    PD_CHECK(pd_tok_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "tokenizer.json: bad JSON at line 1");

    write_file(dir, "tokenizer.json", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}");
    PD_CHECK(pd_tok_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_UNSUPPORTED);
    PD_CHECK_CONTAINS(err.msg, "model type 'WordPiece' is not supported");

    write_file(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]},"
               " \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Punctuation\"}]}}");
    PD_CHECK(pd_tok_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_UNSUPPORTED);
    PD_CHECK_CONTAINS(err.msg, "pre_tokenizer type 'Punctuation'");

    write_file(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}");
    PD_CHECK(pd_tok_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "\"ab\" not in the vocabulary");

    // A minimal valid tokenizer, then a broken tokenizer_config.json beside it.
    write_file(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [[\"a\", \"b\"]]},"
               " \"decoder\": {\"type\": \"Fuse\"}}");
    pd_tok *t = pd_tok_load(dir, &err);
    PD_CHECK(t != NULL);
    pd_tok_ids ids = {0};
    PD_CHECK_EQ(pd_tok_encode(t, "abba", 4, true, true, &ids), PD_OK);
    PD_CHECK_EQ(ids.n, 3);  // ab b a
    PD_CHECK_EQ(ids.ids[0], 2);
    PD_CHECK_EQ(pd_tok_bos_id(t), -1);
    PD_CHECK(pd_tok_chat_template(t) == NULL);
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
    write_file(dir, "tokenizer_config.json", "{\"bos_token\": ");
    PD_CHECK(pd_tok_load(dir, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_PROTO);
    PD_CHECK_CONTAINS(err.msg, "tokenizer_config.json: bad JSON");
    remove_dir(dir);
}

// ---- encode details and accessors ----------------------------------------------------------------

PD_TEST(test_encode_contract) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    pd_tok_ids ids = {0};
    PD_CHECK_EQ(pd_tok_ids_push(&ids, 7), PD_OK);
    PD_CHECK_EQ(pd_tok_encode(t, "bad \xff utf8", 10, false, true, &ids), PD_ERR_INVALID);
    PD_CHECK_EQ(ids.n, 1);  // unchanged on error
    PD_CHECK_EQ(pd_tok_encode(t, "Hello", 5, false, true, &ids), PD_OK);
    PD_CHECK(ids.n > 1 && ids.ids[0] == 7);  // appends
    // parse_special=false: the special token's text is ordinary text.
    const char *chat = "<|im_start|>user";
    ids.n = 0;
    PD_CHECK_EQ(pd_tok_encode(t, chat, strlen(chat), false, true, &ids), PD_OK);
    PD_CHECK_EQ(ids.ids[0], 4094);
    ids.n = 0;
    PD_CHECK_EQ(pd_tok_encode(t, chat, strlen(chat), false, false, &ids), PD_OK);
    PD_CHECK(ids.n > 3);
    for (int i = 0; i < ids.n; i++) PD_CHECK(!pd_tok_is_special(t, ids.ids[i]));
    char *dec;
    size_t dec_len;
    PD_CHECK_EQ(pd_tok_decode(t, ids.ids, ids.n, true, &dec, &dec_len), PD_OK);
    PD_CHECK_STR(dec, chat);
    pd_free(dec);
    // Ids naming no token are skipped, as HF does.
    int32_t odd[] = {39, -5, 100000, 592};
    PD_CHECK_EQ(pd_tok_decode(t, odd, 4, false, &dec, &dec_len), PD_OK);
    PD_CHECK_STR(dec, "Hell");
    pd_free(dec);
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
}

PD_TEST(test_accessors) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    PD_CHECK_EQ(pd_tok_n_vocab(t), 4096);
    PD_CHECK_EQ(pd_tok_bos_id(t), 4092);
    PD_CHECK_EQ(pd_tok_eos_id(t), 4093);
    PD_CHECK_STR(pd_tok_bos_token(t), "<|begin_of_text|>");
    PD_CHECK_STR(pd_tok_eos_token(t), "<|end_of_text|>");
    PD_CHECK(pd_tok_adds_bos(t));
    PD_CHECK_CONTAINS(pd_tok_chat_template(t), "<|im_start|>");
    PD_CHECK(pd_tok_chat_template_named(t, "tool_use") == NULL);
    int32_t the = pd_tok_token_to_id(t, "\xC4\xA0the", 5);  // "Ġthe"
    PD_CHECK(the >= 0);
    size_t n;
    const char *b = pd_tok_token_bytes(t, the, &n);
    PD_CHECK(b && n == 4 && memcmp(b, " the", 4) == 0);
    PD_CHECK_STR(pd_tok_token_str(t, the), "\xC4\xA0the");
    PD_CHECK(!pd_tok_is_special(t, the));
    PD_CHECK(pd_tok_is_special(t, 4095));
    b = pd_tok_token_bytes(t, 4095, &n);
    PD_CHECK(b && n == 10 && memcmp(b, "<|im_end|>", 10) == 0);
    PD_CHECK(pd_tok_token_bytes(t, 4096, &n) == NULL && n == 0);
    PD_CHECK(pd_tok_token_str(t, -1) == NULL);
    PD_CHECK_EQ(pd_tok_token_to_id(t, "no such token", 13), -1);
    pd_tok_free(t);

    t = load_spm();
    PD_REQUIRE(t != NULL);
    PD_CHECK_EQ(pd_tok_bos_id(t), 1);
    PD_CHECK_EQ(pd_tok_eos_id(t), 2);
    PD_CHECK(pd_tok_adds_bos(t));
    PD_CHECK_CONTAINS(pd_tok_chat_template(t), "bos_token");
    PD_CHECK_STR(pd_tok_chat_template_named(t, "tool_use"), "{{ bos_token }}tools");
    b = pd_tok_token_bytes(t, pd_tok_token_to_id(t, "<0x0A>", 6), &n);
    PD_CHECK(b && n == 1 && b[0] == '\n');
    int32_t sthe = pd_tok_token_to_id(t, "\xE2\x96\x81the", 6);  // "▁the"
    b = pd_tok_token_bytes(t, sthe, &n);
    PD_CHECK(b && n == 4 && memcmp(b, " the", 4) == 0);
    pd_tok_free(t);
}

// ---- NFC ------------------------------------------------------------------------------------------

PD_TEST(test_nfc) {
    // Expected values from Python's unicodedata.normalize("NFC", ...).
    static const struct { const char *in, *out; } cases[] = {
        {"e\xCC\x81", "\xC3\xA9"},
        {"A\xCC\x8A\xCC\xA3", "\xE1\xBA\xA0\xCC\x8A"},          // reordering, then composition
        {"\xE1\xB8\x8B\xCC\xA3", "\xE1\xB8\x8D\xCC\x87"},         // decompose, reorder, recompose
        {"\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8", "\xEA\xB0\x81"},  // Hangul L V T
        {"\xE0\xA5\x98", "\xE0\xA4\x95\xE0\xA4\xBC"},             // composition exclusion
        {"\xE2\x84\xAB", "\xC3\x85"},                             // singleton (Angstrom sign)
        {"e\xCC\x80\xCC\x95\xCC\x81", "\xC3\xA8\xCC\x81\xCC\x95"},
        {"\xCC\x88\xCC\x81", "\xCC\x88\xCC\x81"},                 // U+0344 decomposed, not recomposed
        {"plain ascii", "plain ascii"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_buf b = {0};
        PD_CHECK_EQ(pd_tok_nfc(cases[i].in, strlen(cases[i].in), &b), PD_OK);
        PD_CHECK_MSG(b.len == strlen(cases[i].out) && memcmp(b.p, cases[i].out, b.len) == 0, "nfc case %zu", i);
        pd_buf_free(&b);
    }
}

// ---- threads and speed -------------------------------------------------------------------------

typedef struct enc_job {
    const pd_tok *t;
    const char *text;
    size_t len;
    pd_tok_ids ids;
    pd_status st;
} enc_job;

static void *enc_thread(void *arg) {
    enc_job *j = arg;
    for (int k = 0; k < 4 && j->st == PD_OK; k++) {
        j->ids.n = 0;
        j->st = pd_tok_encode(j->t, j->text, j->len, true, true, &j->ids);
    }
    return NULL;
}

static char *kjv_document(int repeat, size_t *len, int *n_tokens_one) {
    char path[1024];
    json_t *root = json_load_file(pd_test_path(path, sizeof(path), "golden/tokenize.json"), 0, NULL);
    if (!root) return NULL;
    json_t *c;
    size_t i;
    const char *passage = NULL;
    json_array_foreach(json_object_get(root, "cases"), i, c) {
        if (!strcmp(json_string_value(json_object_get(c, "name")), "kjv_passage_2000")) {
            passage = json_string_value(json_object_get(c, "text"));
            *n_tokens_one = (int)json_array_size(json_object_get(c, "ids"));
        }
    }
    char *doc = NULL;
    if (passage) {
        size_t pl = strlen(passage);
        doc = pd_malloc(pl * (size_t)repeat + 1);
        for (int r = 0; doc && r < repeat; r++) memcpy(doc + pl * (size_t)r, passage, pl);
        if (doc) doc[pl * (size_t)repeat] = 0;
        *len = pl * (size_t)repeat;
    }
    json_decref(root);
    return doc;
}

PD_TEST(test_concurrent_encode) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    size_t len = 0;
    int n_one = 0;
    char *doc = kjv_document(20, &len, &n_one);
    PD_REQUIRE(doc != NULL);
    enc_job jobs[3];
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        jobs[i] = (enc_job){.t = t, .text = doc, .len = len};
        PD_REQUIRE(pthread_create(&th[i], NULL, enc_thread, &jobs[i]) == 0);
    }
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) {
        PD_CHECK_EQ(jobs[i].st, PD_OK);
        PD_CHECK_EQ(jobs[i].ids.n, jobs[0].ids.n);
        PD_CHECK(memcmp(jobs[i].ids.ids, jobs[0].ids.ids, (size_t)jobs[0].ids.n * sizeof(int32_t)) == 0);
    }
    for (int i = 0; i < 3; i++) pd_tok_ids_free(&jobs[i].ids);
    pd_free(doc);
    pd_tok_free(t);
}

PD_TEST(test_speed_100k_tokens) {
    pd_tok *t = load_shared();
    PD_REQUIRE(t != NULL);
    size_t len = 0;
    int n_one = 0;
    char *doc = kjv_document(186, &len, &n_one);  // 186 x 540 tokens ~ 100k
    PD_REQUIRE(doc != NULL);
    pd_tok_ids ids = {0};
    int64_t t0 = pd_time_us();
    PD_CHECK_EQ(pd_tok_encode(t, doc, len, false, true, &ids), PD_OK);
    int64_t t1 = pd_time_us();
    char *dec;
    size_t dec_len;
    PD_CHECK_EQ(pd_tok_decode(t, ids.ids, ids.n, false, &dec, &dec_len), PD_OK);
    int64_t t2 = pd_time_us();
    PD_CHECK(dec_len == len && memcmp(dec, doc, len) == 0);
    // The passage starts with spaces and a digit, so repetition may merge across boundaries a
    // little; the count stays within a few tokens per repeat of 186 x 540.
    PD_CHECK(ids.n > 186 * 530 && ids.n < 186 * 550);
    printf("  encode: %d tokens (%zu bytes) in %.1f ms; decode in %.1f ms\n", ids.n, len,
           (double)(t1 - t0) / 1000.0, (double)(t2 - t1) / 1000.0);
    pd_free(dec);
    pd_tok_free(t);

    // SentencePiece style (Llama 2 legacy): no pre-tokenizer, so each text between added tokens
    // is ONE word for BPE — the merge loop must stay O(n log n).
    t = load_spm();
    PD_REQUIRE(t != NULL);
    ids.n = 0;
    t0 = pd_time_us();
    PD_CHECK_EQ(pd_tok_encode(t, doc, len, false, true, &ids), PD_OK);
    t1 = pd_time_us();
    PD_CHECK_EQ(pd_tok_decode(t, ids.ids, ids.n, false, &dec, &dec_len), PD_OK);
    t2 = pd_time_us();
    PD_CHECK(dec_len == len && memcmp(dec, doc, len) == 0);
    printf("  spm encode: %d tokens (%zu bytes, one BPE word) in %.1f ms; decode in %.1f ms\n", ids.n, len,
           (double)(t1 - t0) / 1000.0, (double)(t2 - t1) / 1000.0);
    pd_free(dec);
    pd_tok_ids_free(&ids);
    pd_free(doc);
    pd_tok_free(t);
}

// ---- allocation failures ---------------------------------------------------------------------------
// SQLite-style countdown: fail the n-th allocation for n = 0, 1, 2, ... until a call succeeds
// without hitting the fault. Every failure must come back as a clean error (the harness checks
// that nothing leaked), and a benign one (e.g. PCRE2's JIT) may still succeed.

static void fault_loop(const char *dir) {
    int n_load_failures = 0;
    pd_tok *t = NULL;
    for (long n = 0; n < 100000; n++) {
        pd_err err = {0};
        pd_mem_fault_set(n, false);
        t = pd_tok_load(dir, &err);
        long failed = pd_mem_fault_n_failed();
        pd_mem_fault_set(-1, false);
        if (!t) {
            PD_CHECK_MSG(err.status == PD_ERR_NOMEM, "countdown %ld: %s", n, err.msg);
            n_load_failures++;
            continue;
        }
        if (failed == 0) break;
        pd_tok_free(t);
        t = NULL;
    }
    PD_REQUIRE(t != NULL);
    PD_CHECK(n_load_failures > 20);

    const char *text = "Hello <s>world</s> 你好 café [MASK] <|tool|> foo bar\n\n  end";
    pd_tok_ids ref = {0};
    PD_REQUIRE(pd_tok_encode(t, text, strlen(text), true, true, &ref) == PD_OK);
    for (long n = 0; n < 10000; n++) {
        pd_tok_ids ids = {0};
        pd_mem_fault_set(n, false);
        pd_status st = pd_tok_encode(t, text, strlen(text), true, true, &ids);
        char *dec = NULL;
        size_t dec_len = 0;
        pd_status st2 = pd_tok_decode(t, ref.ids, ref.n, false, &dec, &dec_len);
        pd_tok_stream *s = pd_tok_stream_new(t, false);
        pd_status st3 = PD_OK;
        for (int i = 0; s && i < ref.n && st3 == PD_OK; i++) {
            const char *p;
            size_t l;
            st3 = pd_tok_stream_feed(s, ref.ids[i], &p, &l);
        }
        long failed = pd_mem_fault_n_failed();
        pd_mem_fault_set(-1, false);
        PD_CHECK(st == PD_OK || (st == PD_ERR_NOMEM && ids.n == 0));
        if (st == PD_OK) PD_CHECK(ids.n == ref.n && memcmp(ids.ids, ref.ids, (size_t)ref.n * sizeof(int32_t)) == 0);
        PD_CHECK(st2 == PD_OK || (st2 == PD_ERR_NOMEM && dec == NULL));
        PD_CHECK(st3 == PD_OK || st3 == PD_ERR_NOMEM);
        pd_free(dec);
        pd_tok_stream_free(s);
        pd_tok_ids_free(&ids);
        if (failed == 0) break;
    }
    pd_tok_ids_free(&ref);
    pd_tok_free(t);
}

PD_TEST(test_fault_injection) {
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/tests/data/tok/spm", pd_test_repo_dir());
    fault_loop(dir);
    fault_loop(pd_test_path(dir, sizeof(dir), "tokenizer"));
}

// ---- pipeline pieces not covered by the HF fixtures -------------------------------------------------
// Split behaviors, observed through ignore_merges (a piece that is in the vocabulary becomes one
// token). Expected splits follow HF's NormalizedString::split.

static pd_tok *load_json_tok(const char *json) {
    char dir[] = "/tmp/pd_tok_test_XXXXXX";
    if (!mkdtemp(dir)) return NULL;
    write_file(dir, "tokenizer.json", json);
    pd_err err = {0};
    pd_tok *t = pd_tok_load(dir, &err);
    if (!t) fprintf(stderr, "  load failed: %s\n", err.msg);
    remove_dir(dir);
    return t;
}

static void check_ids(pd_tok *t, const char *text, const int32_t *want, int n_want) {
    pd_tok_ids ids = {0};
    PD_CHECK_EQ(pd_tok_encode(t, text, strlen(text), false, true, &ids), PD_OK);
    bool ok = ids.n == n_want;
    for (int i = 0; ok && i < n_want; i++) ok = ids.ids[i] == want[i];
    PD_CHECK_MSG(ok, "\"%s\": got %d ids: %d %d %d", text, ids.n, ids.n > 0 ? ids.ids[0] : -1, ids.n > 1 ? ids.ids[1] : -1, ids.n > 2 ? ids.ids[2] : -1);
    pd_tok_ids_free(&ids);
}

PD_TEST(test_split_behaviors) {
    static const char *behaviors[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    static const int32_t want[5][3] = {{0, 1, -1}, {0, 2, 1}, {3, 1, -1}, {0, 4, -1}, {0, 7, 1}};
    static const int n_want[5] = {2, 3, 2, 2, 3};
    for (int b = 0; b < 5; b++) {
        char json[1024];
        snprintf(json, sizeof(json),
                 "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": true, \"merges\": [],"
                 " \"vocab\": {\"a\": 0, \"b\": 1, \"-\": 2, \"a-\": 3, \"-b\": 4, \"ab\": 5, \"a-b\": 6, \"--\": 7}},"
                 " \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, \"behavior\": \"%s\","
                 " \"invert\": false}}", behaviors[b]);
        pd_tok *t = load_json_tok(json);
        PD_REQUIRE(t != NULL);
        check_ids(t, b == 4 ? "a--b" : "a-b", want[b], n_want[b]);
        pd_tok_free(t);
    }
    // invert flips what counts as a match: Removed on an inverted "-" drops everything else
    // (HF's Whitespace pre-tokenizer is \w+|[^\w\s]+ inverted and Removed).
    pd_tok *t = load_json_tok(
        "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": true, \"merges\": [],"
        " \"vocab\": {\"a\": 0, \"b\": 1, \"-\": 2}},"
        " \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"-\"}, \"behavior\": \"Removed\", \"invert\": true}}");
    PD_REQUIRE(t != NULL);
    static const int32_t inv[] = {2};
    check_ids(t, "a-b", inv, 1);
    pd_tok_free(t);
    t = load_json_tok(
        "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": true, \"merges\": [],"
        " \"vocab\": {\"ab\": 0, \"cd\": 1, \"!\": 2, \"a\": 3, \"b\": 4, \"c\": 5, \"d\": 6}},"
        " \"pre_tokenizer\": {\"type\": \"Whitespace\"}}");
    PD_REQUIRE(t != NULL);
    static const int32_t ws[] = {0, 2, 1};
    check_ids(t, "  ab!  cd ", ws, 3);
    pd_tok_free(t);
}

// Steps after Fuse stream over one growing string: a Replace with a two-byte pattern split across
// tokens, and Strip with stop > 0. Property: the stream equals decode() for random id sequences.
PD_TEST(test_stream_fragment_steps_match_decode) {
    pd_tok *t = load_json_tok(
        "{\"model\": {\"type\": \"BPE\", \"merges\": [],"
        " \"vocab\": {\"a\": 0, \"b\": 1, \" \": 2, \"ab\": 3, \"x\": 4, \"\\u00e9\": 5}},"
        " \"added_tokens\": [{\"id\": 6, \"content\": \"<s>\", \"special\": true}],"
        " \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"},"
        "   {\"type\": \"Replace\", \"pattern\": {\"String\": \"ab\"}, \"content\": \"Y\"},"
        "   {\"type\": \"Strip\", \"content\": \" \", \"start\": 2, \"stop\": 2}]}}");
    PD_REQUIRE(t != NULL);
    int32_t ids1[] = {2, 2, 2, 0, 1, 3, 2, 4, 2, 2, 2};  // "   abab x   "
    char *dec;
    size_t len;
    PD_CHECK_EQ(pd_tok_decode(t, ids1, 11, false, &dec, &len), PD_OK);
    PD_CHECK_STR(dec, " YY x ");
    pd_free(dec);
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    for (int iter = 0; iter < 300; iter++) {
        int32_t ids[24];
        int n = (int)(pd_rng_next(&rng) % 24);
        for (int i = 0; i < n; i++) ids[i] = (int32_t)(pd_rng_next(&rng) % 8) - 1;  // includes -1 and 7 (no token)
        bool skip = iter & 1;
        PD_REQUIRE(pd_tok_decode(t, ids, n, skip, &dec, &len) == PD_OK);
        pd_tok_stream *s = pd_tok_stream_new(t, skip);
        PD_REQUIRE(s != NULL);
        char acc[256];
        size_t acc_len = 0;
        for (int i = 0; i <= n; i++) {
            const char *p;
            size_t l;
            PD_CHECK_EQ(i < n ? pd_tok_stream_feed(s, ids[i], &p, &l) : pd_tok_stream_finish(s, &p, &l), PD_OK);
            PD_REQUIRE(acc_len + l < sizeof(acc));
            memcpy(acc + acc_len, p, l);
            acc_len += l;
        }
        PD_CHECK_MSG(acc_len == len && memcmp(acc, dec, len) == 0, "iter %d: stream \"%.*s\" decode \"%s\"", iter,
                     (int)acc_len, acc, dec);
        pd_free(dec);
        pd_tok_stream_free(s);
    }
    pd_tok_free(t);
}

// NFC normalizer through the whole encoder; a char with no token, no unk and no byte fallback
// (here NUL) is dropped, as HF's BPE does.
static size_t unhex(const char *h, size_t n, char *out) {
    size_t k = 0;
    for (size_t i = 0; i + 1 < n; i += 2) {
        unsigned v;
        sscanf(h + i, "%2x", &v);
        out[k++] = (char)v;
    }
    return k;
}

// 3000 random mixes of combining marks, precomposed letters, Hangul, Indic nuktas, singletons and
// exclusions, against Python's unicodedata.normalize("NFC") (tests/data/tok/nfc/cases.txt).
PD_TEST(test_nfc_against_python) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/tok/nfc/cases.txt", pd_test_repo_dir());
    char *txt = NULL;
    size_t len = 0;
    PD_REQUIRE(pd_file_read_all(path, &txt, &len, NULL) == PD_OK);
    int n_cases = 0, n_bad = 0;
    for (char *line = txt, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        if (line[0] == '#') continue;
        char *sp = strchr(line, ' ');
        if (!sp) continue;
        char in[64], want[64];
        size_t n_in = unhex(line, (size_t)(sp - line), in), n_want = unhex(sp + 1, strlen(sp + 1), want);
        pd_buf b = {0};
        PD_CHECK_EQ(pd_tok_nfc(in, n_in, &b), PD_OK);
        if (b.len != n_want || memcmp(b.p, want, n_want) != 0) {
            if (n_bad++ < 5) PD_FAIL_("nfc mismatch for %s", line);
        }
        pd_buf_free(&b);
        // Allocation failure: a clean PD_ERR_NOMEM, nothing leaked (checked by the harness).
        if (n_cases % 500 == 0) {
            pd_mem_fault_set(0, false);
            pd_status st = pd_tok_nfc(in, n_in, &b);
            pd_mem_fault_set(-1, false);
            PD_CHECK(st == PD_OK || st == PD_ERR_NOMEM);
            pd_buf_free(&b);
        }
        n_cases++;
    }
    PD_CHECK_EQ(n_cases, 3000);
    PD_CHECK_EQ(n_bad, 0);
    pd_free(txt);
}

PD_TEST(test_nfc_normalizer_in_pipeline) {
    pd_tok *t = load_json_tok(
        "{\"model\": {\"type\": \"BPE\", \"merges\": [], \"vocab\": {\"e\": 0, \"\\u00e9\": 1, \"\\u0301\": 2}},"
        " \"normalizer\": {\"type\": \"NFC\"}}");
    PD_REQUIRE(t != NULL);
    pd_tok_ids ids = {0};
    PD_CHECK_EQ(pd_tok_encode(t, "e\xCC\x81" "\0e", 5, false, true, &ids), PD_OK);
    PD_CHECK_EQ(ids.n, 2);
    if (ids.n == 2) {
        PD_CHECK_EQ(ids.ids[0], 1);  // e + U+0301 composed to é
        PD_CHECK_EQ(ids.ids[1], 0);
    }
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
}
