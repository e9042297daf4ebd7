// Model loading error paths: each failure names the problem (architecture, dtype, tensor name and
// shape, truncated file, bad JSON), and a failed load frees everything (the harness checks leaks).
#include <jansson.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/generate.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test.h"

static char g_tmp[256];

static const char *mktmp(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/pd_test_load_XXXXXX");
    PD_ASSERT(mkdtemp(g_tmp));
    return g_tmp;
}

static void write_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    PD_ASSERT(f);
    fwrite(data, 1, n, f);
    fclose(f);
}

static void rm_dir(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    PD_ASSERT(system(cmd) == 0);
}

static const char *CFG =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":8,\"intermediate_size\":16,\"num_hidden_layers\":1,"
    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"vocab_size\":10,\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,"
    "\"tie_word_embeddings\":true,\"max_position_embeddings\":64}";

// Writes a safetensors file holding the given tensors (f32, zero data), with optional defects.
typedef struct spec { const char *name; int64_t r, c; const char *dtype; } spec;
static void write_st(const char *dir, const char *fname, const spec *t, int n, size_t truncate_by) {
    json_t *h = json_object();
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t esz = !strcmp(t[i].dtype, "F32") ? 4 : !strcmp(t[i].dtype, "I64") ? 8 : 2;
        size_t bytes = (size_t)(t[i].r * (t[i].c ? t[i].c : 1)) * esz;
        json_t *shape = t[i].c ? json_pack("[II]", (json_int_t)t[i].r, (json_int_t)t[i].c) : json_pack("[I]", (json_int_t)t[i].r);
        json_object_set_new(h, t[i].name, json_pack("{s:s,s:o,s:[II]}", "dtype", t[i].dtype, "shape", shape, "data_offsets",
                                                    (json_int_t)off, (json_int_t)(off + bytes)));
        off += bytes;
    }
    char *hs = json_dumps(h, JSON_COMPACT);
    size_t hl = strlen(hs), total = 8 + hl + off - truncate_by;
    unsigned char *buf = calloc(1, 8 + hl + off);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, hs, hl);
    write_file(dir, fname, buf, total);
    free(buf);
    free(hs);
    json_decref(h);
}

static const spec FULL[] = {
    {"model.embed_tokens.weight", 10, 8, "F32"}, {"model.norm.weight", 8, 0, "F32"},
    {"model.layers.0.input_layernorm.weight", 8, 0, "F32"}, {"model.layers.0.post_attention_layernorm.weight", 8, 0, "F32"},
    {"model.layers.0.self_attn.q_proj.weight", 8, 8, "F32"}, {"model.layers.0.self_attn.k_proj.weight", 4, 8, "F32"},
    {"model.layers.0.self_attn.v_proj.weight", 4, 8, "F32"}, {"model.layers.0.self_attn.o_proj.weight", 8, 8, "F32"},
    {"model.layers.0.mlp.gate_proj.weight", 16, 8, "F32"}, {"model.layers.0.mlp.up_proj.weight", 16, 8, "F32"},
    {"model.layers.0.mlp.down_proj.weight", 8, 16, "BF16"},
};

static pd_model *try_load(const char *dir, pd_err *err) {
    pd_backend *be = pd_backend_cpu_new(1);
    pd_model_params p = pd_model_params_default();
    p.dir = dir;
    p.backend = be;
    pd_model *m = pd_model_load(&p, err);
    pd_model_free(m);
    pd_backend_free(be);
    return m;
}

PD_TEST(load_ok_synthetic) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model.safetensors", FULL, (int)PD_ARRAY_LEN(FULL), 0);
    pd_err err = {0};
    PD_CHECK_MSG(try_load(d, &err) != NULL, "load failed: %s", err.msg);
    rm_dir(d);
}

PD_TEST(load_missing_tensor_named) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model.safetensors", FULL, (int)PD_ARRAY_LEN(FULL) - 1, 0);
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "missing tensor 'model.layers.0.mlp.down_proj.weight'");
    rm_dir(d);
}

PD_TEST(load_misshaped_tensor_named) {
    const char *d = mktmp();
    spec t[PD_ARRAY_LEN(FULL)];
    memcpy(t, FULL, sizeof FULL);
    t[5].r = 6;  // k_proj rows
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model.safetensors", t, (int)PD_ARRAY_LEN(t), 0);
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [6, 8], expected [4, 8]");
    rm_dir(d);
}

PD_TEST(load_unsupported_dtype_named) {
    const char *d = mktmp();
    spec t[PD_ARRAY_LEN(FULL)];
    memcpy(t, FULL, sizeof FULL);
    t[1].dtype = "I64";
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model.safetensors", t, (int)PD_ARRAY_LEN(t), 0);
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "tensor 'model.norm.weight' has unsupported dtype I64");
    rm_dir(d);
}

PD_TEST(load_truncated_file) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model.safetensors", FULL, (int)PD_ARRAY_LEN(FULL), 100);
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "truncated file");
    // a file shorter than its header length
    write_file(d, "model.safetensors", "\xff\x00\x00\x00\x00\x00\x00\x00{}", 10);
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "truncated file or bad header length 255");
    rm_dir(d);
}

PD_TEST(load_bad_json_config) {
    const char *d = mktmp();
    write_file(d, "config.json", "{\"architectures\": [", 19);
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "config.json: bad JSON at line 1");
    rm_dir(d);
}

PD_TEST(load_unknown_architecture) {
    const char *d = mktmp();
    const char *cfg = "{\"architectures\":[\"GPTNeoXForCausalLM\"],\"hidden_size\":8}";
    write_file(d, "config.json", cfg, strlen(cfg));
    pd_err err = {0};
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "unknown architecture 'GPTNeoXForCausalLM'");
    PD_CHECK_EQ(err.status, PD_ERR_UNSUPPORTED);
    rm_dir(d);
}

PD_TEST(load_missing_files) {
    pd_err err = {0};
    PD_CHECK(try_load("/nonexistent/model", &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "/nonexistent/model/config.json");
    PD_CHECK_EQ(err.status, PD_ERR_NOTFOUND);
    const char *d = mktmp();
    write_file(d, "config.json", CFG, strlen(CFG));
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "no model.safetensors or model.safetensors.index.json");
    rm_dir(d);
}

PD_TEST(config_fields_checked) {
    pd_model_config c;
    pd_err err = {0};
    PD_CHECK(pd_model_config_parse("{\"architectures\":[\"LlamaForCausalLM\"]}", 38, &c, &err) != PD_OK);
    PD_CHECK_CONTAINS(err.msg, "missing field 'vocab_size'");
    const char *bad_rope =
        "{\"architectures\":[\"MistralForCausalLM\"],\"hidden_size\":8,\"intermediate_size\":16,\"num_hidden_layers\":1,"
        "\"num_attention_heads\":2,\"vocab_size\":10,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}";
    PD_CHECK(pd_model_config_parse(bad_rope, strlen(bad_rope), &c, &err) == PD_ERR_UNSUPPORTED);
    PD_CHECK_CONTAINS(err.msg, "unsupported rope_scaling type 'yarn'");
    const char *gqa =
        "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":8,\"intermediate_size\":16,\"num_hidden_layers\":1,"
        "\"num_attention_heads\":3,\"num_key_value_heads\":2,\"vocab_size\":10}";
    PD_CHECK(pd_model_config_parse(gqa, strlen(gqa), &c, &err) == PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "not a multiple of num_key_value_heads");
    // Linear rope scaling divides every frequency by the factor.
    const char *lin =
        "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":8,\"intermediate_size\":16,\"num_hidden_layers\":1,"
        "\"num_attention_heads\":2,\"vocab_size\":10,\"rope_theta\":100.0,\"rope_scaling\":{\"type\":\"linear\",\"factor\":4.0}}";
    PD_REQUIRE(pd_model_config_parse(lin, strlen(lin), &c, &err) == PD_OK);
    float f[2];
    pd_model_config_inv_freq(&c, f);
    PD_CHECK_NEAR(f[0], 0.25, 1e-7);
    PD_CHECK_NEAR(f[1], 0.1 / 4, 1e-7);
    PD_CHECK_EQ(c.head_dim, 4);
}

// A sharded checkpoint (index.json + 2 shards) loads like a single file; a tensor listed in the
// index but absent from its shard is named.
PD_TEST(load_sharded) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG, strlen(CFG));
    write_st(d, "model-00001-of-00002.safetensors", FULL, 5, 0);
    write_st(d, "model-00002-of-00002.safetensors", FULL + 5, (int)PD_ARRAY_LEN(FULL) - 5, 0);
    json_t *wm = json_object();
    for (size_t i = 0; i < PD_ARRAY_LEN(FULL); i++)
        json_object_set_new(wm, FULL[i].name, json_string(i < 5 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors"));
    json_t *idx = json_pack("{s:{},s:o}", "metadata", "weight_map", wm);
    char *s = json_dumps(idx, 0);
    write_file(d, "model.safetensors.index.json", s, strlen(s));
    free(s);
    pd_err err = {0};
    PD_CHECK_MSG(try_load(d, &err) != NULL, "sharded load failed: %s", err.msg);
    json_object_set_new(wm, "model.extra.weight", json_string("model-00002-of-00002.safetensors"));
    s = json_dumps(idx, 0);
    write_file(d, "model.safetensors.index.json", s, strlen(s));
    free(s);
    PD_CHECK(try_load(d, &err) == NULL);
    PD_CHECK_CONTAINS(err.msg, "tensor 'model.extra.weight' is listed in the index but missing from shard");
    json_decref(idx);
    rm_dir(d);
}

// bf16/f16/f32 conversions are exact where they must be.
PD_TEST(half_conversions) {
    PD_CHECK_EQ(pd_f32_to_bf16(1.0f), 0x3f80);
    PD_CHECK_NEAR(pd_bf16_to_f32(0x3f80), 1.0, 0);
    PD_CHECK_NEAR(pd_f16_to_f32(0x3c00), 1.0, 0);
    PD_CHECK_NEAR(pd_f16_to_f32(0x0001), 5.960464477539063e-08, 1e-15);
    PD_CHECK_EQ(pd_f32_to_f16(65504.0f), 0x7bff);
    PD_CHECK_EQ(pd_f32_to_f16(-2.0f), 0xc000);
    for (int h = 0; h < 0x7c00; h += 7) PD_CHECK_EQ(pd_f32_to_f16(pd_f16_to_f32((uint16_t)h)), h);
}

// The controlled-acceptance fixture (--dummy-residual-scale, --dummy-num-layers): a dummy target
// whose layers 1.. write into the residual stream scaled by 0 is, token for token, the same model
// cut to its first layer — which only holds if the cut model's seeds (embeddings, layer 0, final
// norm, lm_head) are the full model's. Both with and without biases (a layer's seed count differs).
static const char *CFG_FIX[] = {
    "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":512,\"intermediate_size\":1536,\"num_hidden_layers\":4,"
    "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"vocab_size\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,"
    "\"tie_word_embeddings\":false,\"max_position_embeddings\":128}",
    "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":512,\"intermediate_size\":1536,\"num_hidden_layers\":3,"
    "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"vocab_size\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,"
    "\"attention_bias\":true,\"mlp_bias\":true,\"tie_word_embeddings\":false,\"max_position_embeddings\":128}",
};

#define FIX_N 24
// Greedy tokens of a dummy model from `dir` (seed, cut to n_layers if > 0, layers from.. scaled by eps).
static pd_status fix_gen_p(const char *dir, uint64_t seed, int n_layers, int from, float eps, const int32_t *prompt, int n_prompt,
                           int32_t *out, pd_err *err);
static pd_status fix_gen(const char *dir, uint64_t seed, int n_layers, int from, float eps, int32_t *out, pd_err *err) {
    static const int32_t prompt[] = {3, 17, 200, 45, 9, 88};
    return fix_gen_p(dir, seed, n_layers, from, eps, prompt, 6, out, err);
}

static pd_status fix_gen_p(const char *dir, uint64_t seed, int n_layers, int from, float eps, const int32_t *prompt, int n_prompt,
                           int32_t *out, pd_err *err) {
    pd_backend *be = pd_backend_cpu_new(1);
    pd_model_params p = pd_model_params_default();
    p.dir = dir;
    p.backend = be;
    p.dummy = true;
    p.seed = seed;
    p.dummy_num_layers = n_layers;
    p.dummy_scale_from = from;
    p.dummy_scale_eps = eps;
    pd_model *m = pd_model_load(&p, err);
    pd_status st = PD_ERR_INVALID;
    if (m) {
        pd_gen_seq s = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = FIX_N, .ignore_eos = true,
                        .sampling = pd_sampling_params_default(), .out_ids = out};
        s.sampling.temperature = 0;
        pd_gen_params gp = pd_gen_params_default();
        st = pd_generate(m, &s, 1, &gp, err);
        if (!st && s.n_out != FIX_N) st = PD_ERR_INVALID;
    }
    pd_model_free(m);
    pd_backend_free(be);
    return st;
}

PD_TEST(dummy_fixture_truncated_draft_equals_scaled_target) {
    for (size_t c = 0; c < PD_ARRAY_LEN(CFG_FIX); c++) {
        const char *d = mktmp();
        write_file(d, "config.json", CFG_FIX[c], strlen(CFG_FIX[c]));
        pd_err err = {0};
        int32_t target[FIX_N], draft[FIX_N], plain[FIX_N], other[FIX_N];
        PD_CHECK_MSG(fix_gen(d, 1234, 0, 1, 0.0f, target, &err) == PD_OK, "target: %s", err.msg);
        PD_CHECK_MSG(fix_gen(d, 1234, 1, 0, 0.0f, draft, &err) == PD_OK, "draft: %s", err.msg);
        PD_CHECK_MSG(fix_gen(d, 1234, 0, 0, 0.0f, plain, &err) == PD_OK, "plain: %s", err.msg);
        PD_CHECK_MSG(fix_gen(d, 1235, 1, 0, 0.0f, other, &err) == PD_OK, "other seed: %s", err.msg);
        int same = 0, same_plain = 0, same_other = 0, distinct = 0;
        for (int i = 0; i < FIX_N; i++) {
            same += target[i] == draft[i];
            same_plain += plain[i] == draft[i];
            same_other += other[i] == target[i];
            distinct += i == 0 || target[i] != target[i - 1];
        }
        PD_CHECK_MSG(same == FIX_N, "config %zu: the cut draft matches the eps=0 target on %d of %d tokens", c, same, FIX_N);
        // Not vacuous: the unscaled model, and the cut model of another seed, are other models.
        PD_CHECK_MSG(same_plain < FIX_N / 2, "config %zu: the unscaled target matches the draft on %d of %d", c, same_plain, FIX_N);
        PD_CHECK_MSG(same_other < FIX_N / 2, "config %zu: another seed matches on %d of %d", c, same_other, FIX_N);
        PD_CHECK_MSG(distinct > 4, "config %zu: the output is degenerate (%d changes)", c, distinct);
        // eps = 1 is the unscaled model exactly; a cut to all layers is the model itself.
        int32_t one[FIX_N], all[FIX_N];
        PD_CHECK_EQ(fix_gen(d, 1234, 0, 1, 1.0f, one, &err), PD_OK);
        int n_layers = c == 0 ? 4 : 3;
        PD_CHECK_EQ(fix_gen(d, 1234, n_layers, 0, 0.0f, all, &err), PD_OK);
        PD_CHECK(!memcmp(one, plain, sizeof one));
        PD_CHECK(!memcmp(all, plain, sizeof all));
        rm_dir(d);
    }
}

// PD_DUMMY_SCALE_ALL at EPS 0 (bench-spec --dummy-residual-scale 0:0, the copy workload's target):
// every layer's residual write is 0, the last hidden state is the last token's embedding, so the
// output after a prompt depends on its last token alone; the same weights at FROM 1 (layer 0
// writes) do depend on the context.
PD_TEST(dummy_fixture_markov_target) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG_FIX[0], strlen(CFG_FIX[0]));
    pd_err err = {0};
    static const int32_t a[] = {3, 17, 200, 45, 9, 88}, b[] = {250, 7, 7, 1, 88}, c[] = {3, 17, 200, 45, 9, 89};
    int32_t oa[FIX_N], ob[FIX_N], oc[FIX_N], la[FIX_N], lb[FIX_N];
    PD_CHECK_MSG(fix_gen_p(d, 1234, 0, PD_DUMMY_SCALE_ALL, 0.0f, a, 6, oa, &err) == PD_OK, "%s", err.msg);
    PD_CHECK_EQ(fix_gen_p(d, 1234, 0, PD_DUMMY_SCALE_ALL, 0.0f, b, 5, ob, &err), PD_OK);
    PD_CHECK_EQ(fix_gen_p(d, 1234, 0, PD_DUMMY_SCALE_ALL, 0.0f, c, 6, oc, &err), PD_OK);
    PD_CHECK(!memcmp(oa, ob, sizeof oa));  // same last token, another context: the same output
    PD_CHECK(memcmp(oa, oc, sizeof oa));   // another last token: another output
    PD_CHECK_EQ(fix_gen_p(d, 1234, 0, 1, 0.0f, a, 6, la, &err), PD_OK);
    PD_CHECK_EQ(fix_gen_p(d, 1234, 0, 1, 0.0f, b, 5, lb, &err), PD_OK);
    PD_CHECK(memcmp(la, lb, sizeof la));  // layer 0 writing: the context matters
    rm_dir(d);
}

// The knobs are benchmark fixtures: refused on real weights and outside the config's shape.
PD_TEST(dummy_fixture_refusals) {
    const char *d = mktmp();
    write_file(d, "config.json", CFG_FIX[0], strlen(CFG_FIX[0]));
    pd_backend *be = pd_backend_cpu_new(1);
    struct { bool dummy; int n, from; float eps; const char *msg; } cases[] = {
        {false, 1, 0, 0, "need --load-format dummy"},
        {false, 0, 1, 0.5f, "need --load-format dummy"},
        {true, 5, 0, 0, "--dummy-num-layers 5: the config has 4 layers"},
        {true, -1, 0, 0, "--dummy-num-layers -1"},
        {true, 0, 4, 0.5f, "FROM 4 must be 1..3"},
        {true, 2, 2, 0.5f, "FROM 2 must be 1..1"},
        {true, 0, -2, 0.5f, "FROM -2 must be"},
        {true, 0, PD_DUMMY_SCALE_ALL, 1.5f, "EPS 1.5 must be in [0, 1]"},
        {true, 0, 1, 1.5f, "EPS 1.5 must be in [0, 1]"},
        {true, 0, 1, -0.1f, "must be in [0, 1]"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_model_params p = pd_model_params_default();
        p.dir = d;
        p.backend = be;
        p.dummy = cases[i].dummy;
        p.dummy_num_layers = cases[i].n;
        p.dummy_scale_from = cases[i].from;
        p.dummy_scale_eps = cases[i].eps;
        pd_err err = {0};
        pd_model *m = pd_model_load(&p, &err);
        PD_CHECK_MSG(m == NULL, "case %zu loaded", i);
        pd_model_free(m);
        PD_CHECK_CONTAINS(err.msg, cases[i].msg);
    }
    pd_backend_free(be);
    rm_dir(d);
}
