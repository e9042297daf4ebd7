// config.c — config.json parsing with jansson. Every required field is checked for presence and
// range, and the error names it, because a wrong config silently produces garbage logits.
#include "model/config.h"

#include <jansson.h>
#include <math.h>
#include <string.h>

static pd_status get_int(json_t *o, const char *key, int *out, bool required, int lo, int hi, pd_err *err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return pd_err_set(err, PD_ERR_INVALID, "config.json: missing field '%s'", key);
        return PD_OK;
    }
    if (!json_is_integer(v))
        return pd_err_set(err, PD_ERR_INVALID, "config.json: field '%s' must be an integer", key);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return pd_err_set(err, PD_ERR_INVALID, "config.json: field '%s' = %lld out of range [%d, %d]", key,
                          (long long)x, lo, hi);
    *out = (int)x;
    return PD_OK;
}

static pd_status get_num(json_t *o, const char *key, double *out, bool required, pd_err *err) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return pd_err_set(err, PD_ERR_INVALID, "config.json: missing field '%s'", key);
        return PD_OK;
    }
    if (!json_is_number(v)) return pd_err_set(err, PD_ERR_INVALID, "config.json: field '%s' must be a number", key);
    *out = json_number_value(v);
    return PD_OK;
}

static bool get_bool(json_t *o, const char *key, bool dflt) {
    json_t *v = json_object_get(o, key);
    return v && json_is_boolean(v) ? json_is_true(v) : dflt;
}

// eos_token_id may be an int or a list of ints; appends unique ids.
static void add_eos(pd_model_config *c, json_t *v) {
    if (json_is_integer(v)) {
        int id = (int)json_integer_value(v);
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_token_ids[i] == id) return;
        if (c->n_eos < PD_MAX_EOS) c->eos_token_ids[c->n_eos++] = id;
    } else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) add_eos(c, e);
    }
}

static pd_status parse_rope(json_t *root, pd_model_config *c, pd_err *err) {
    // transformers >= 5 may write "rope_parameters"; older files "rope_scaling".
    json_t *rs = json_object_get(root, "rope_scaling");
    if (!rs || json_is_null(rs)) rs = json_object_get(root, "rope_parameters");
    if (!rs || json_is_null(rs)) return PD_OK;
    if (!json_is_object(rs)) return pd_err_set(err, PD_ERR_INVALID, "config.json: 'rope_scaling' must be an object");
    json_t *t = json_object_get(rs, "rope_type");
    if (!t) t = json_object_get(rs, "type");
    const char *type = json_is_string(t) ? json_string_value(t) : "default";
    double theta = 0;
    if (get_num(rs, "rope_theta", &theta, false, err)) return err ? err->status : PD_ERR_INVALID;
    if (theta > 0) c->rope_theta = theta;
    if (!strcmp(type, "default")) return PD_OK;
    if (!strcmp(type, "linear")) {
        c->rope_type = PD_ROPE_LINEAR;
        if (get_num(rs, "factor", &c->rope_factor, true, err)) return PD_ERR_INVALID;
    } else if (!strcmp(type, "llama3")) {
        c->rope_type = PD_ROPE_LLAMA3;
        if (get_num(rs, "factor", &c->rope_factor, true, err) ||
            get_num(rs, "low_freq_factor", &c->rope_low_freq_factor, true, err) ||
            get_num(rs, "high_freq_factor", &c->rope_high_freq_factor, true, err) ||
            get_int(rs, "original_max_position_embeddings", &c->rope_original_max_position, true, 1, 1 << 30, err))
            return PD_ERR_INVALID;
        if (c->rope_high_freq_factor <= c->rope_low_freq_factor)
            return pd_err_set(err, PD_ERR_INVALID, "config.json: rope_scaling high_freq_factor must exceed low_freq_factor");
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "config.json: unsupported rope_scaling type '%s' (supported: default, linear, llama3)", type);
    }
    if (!(c->rope_factor > 0)) return pd_err_set(err, PD_ERR_INVALID, "config.json: rope_scaling factor must be > 0");
    return PD_OK;
}

static pd_status parse_root(json_t *root, pd_model_config *c, pd_err *err) {
    if (!json_is_object(root)) return pd_err_set(err, PD_ERR_INVALID, "config.json: top level must be an object");
    json_t *archs = json_object_get(root, "architectures");
    json_t *a0 = json_is_array(archs) ? json_array_get(archs, 0) : NULL;
    const char *arch = json_is_string(a0) ? json_string_value(a0) : NULL;
    if (!arch) return pd_err_set(err, PD_ERR_INVALID, "config.json: missing field 'architectures'");
    if (!strcmp(arch, "LlamaForCausalLM")) c->arch = PD_ARCH_LLAMA;
    else if (!strcmp(arch, "MistralForCausalLM")) c->arch = PD_ARCH_MISTRAL;
    else if (!strcmp(arch, "Qwen2ForCausalLM")) c->arch = PD_ARCH_QWEN2;
    else
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "config.json: unknown architecture '%s' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)", arch);
    snprintf(c->arch_name, sizeof c->arch_name, "%s", arch);

    const int BIG = 1 << 24;
    if (get_int(root, "vocab_size", &c->vocab_size, true, 1, BIG, err) ||
        get_int(root, "hidden_size", &c->hidden_size, true, 1, BIG, err) ||
        get_int(root, "intermediate_size", &c->intermediate_size, true, 1, BIG, err) ||
        get_int(root, "num_hidden_layers", &c->n_layers, true, 1, 4096, err) ||
        get_int(root, "num_attention_heads", &c->n_heads, true, 1, 4096, err))
        return err ? err->status : PD_ERR_INVALID;
    c->n_kv_heads = c->n_heads;
    c->max_position_embeddings = 4096;
    if (get_int(root, "num_key_value_heads", &c->n_kv_heads, false, 1, 4096, err) ||
        get_int(root, "max_position_embeddings", &c->max_position_embeddings, false, 1, 1 << 30, err))
        return err ? err->status : PD_ERR_INVALID;
    c->head_dim = c->hidden_size / c->n_heads;
    if (get_int(root, "head_dim", &c->head_dim, false, 2, 1024, err)) return err ? err->status : PD_ERR_INVALID;
    if (c->n_heads % c->n_kv_heads)
        return pd_err_set(err, PD_ERR_INVALID, "config.json: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                          c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 || c->head_dim > 1024)
        return pd_err_set(err, PD_ERR_INVALID, "config.json: head_dim %d must be even and <= 1024", c->head_dim);

    double eps = 1e-6, theta = 10000.0;
    if (get_num(root, "rms_norm_eps", &eps, false, err) || get_num(root, "rope_theta", &theta, false, err))
        return err ? err->status : PD_ERR_INVALID;
    c->rms_norm_eps = (float)eps;
    c->rope_theta = theta;
    c->rope_type = PD_ROPE_DEFAULT;
    c->rope_factor = 1.0;
    pd_status st = parse_rope(root, c, err);
    if (st) return st;
    if (!(c->rope_theta > 0)) return pd_err_set(err, PD_ERR_INVALID, "config.json: rope_theta must be > 0");

    c->tie_word_embeddings = get_bool(root, "tie_word_embeddings", false);
    c->attention_bias = c->arch == PD_ARCH_QWEN2 ? true : get_bool(root, "attention_bias", false);
    c->mlp_bias = get_bool(root, "mlp_bias", false);
    if (c->arch == PD_ARCH_MISTRAL || (c->arch == PD_ARCH_QWEN2 && get_bool(root, "use_sliding_window", false)))
        get_int(root, "sliding_window", &c->sliding_window, false, 0, 1 << 30, NULL);

    json_t *act = json_object_get(root, "hidden_act");
    if (act && json_is_string(act) && strcmp(json_string_value(act), "silu"))
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "config.json: unsupported hidden_act '%s' (only silu)", json_string_value(act));

    c->bos_token_id = -1;
    get_int(root, "bos_token_id", &c->bos_token_id, false, 0, BIG, NULL);
    add_eos(c, json_object_get(root, "eos_token_id"));

    json_t *dt = json_object_get(root, "torch_dtype");
    if (!dt) dt = json_object_get(root, "dtype");
    const char *d = json_is_string(dt) ? json_string_value(dt) : "bfloat16";
    c->torch_dtype = !strcmp(d, "float32") ? PD_DTYPE_F32 : !strcmp(d, "float16") ? PD_DTYPE_F16 : PD_DTYPE_BF16;
    return PD_OK;
}

pd_status pd_model_config_parse(const char *text, size_t len, pd_model_config *out, pd_err *err) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    if (!root) return pd_err_set(err, PD_ERR_INVALID, "config.json: bad JSON at line %d column %d: %s", je.line, je.column, je.text);
    pd_status st = parse_root(root, out, err);
    json_decref(root);
    return st;
}

pd_status pd_model_config_load(const char *dir, pd_model_config *out, pd_err *err) {
    char *path = pd_path_join(dir, "config.json");
    if (!path) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    char *text = NULL;
    size_t len = 0;
    pd_status st = pd_file_read_all(path, &text, &len, err);
    pd_free(path);
    if (st) return st;
    st = pd_model_config_parse(text, len, out, err);
    pd_free(text);
    if (st) return st;
    // generation_config.json's eos ids are what generate() stops on; merge them.
    path = pd_path_join(dir, "generation_config.json");
    if (path && pd_file_read_all(path, &text, &len, NULL) == PD_OK) {
        json_t *g = json_loadb(text, len, 0, NULL);
        if (g) {
            add_eos(out, json_object_get(g, "eos_token_id"));
            json_decref(g);
        }
        pd_free(text);
    }
    pd_free(path);
    return PD_OK;
}

void pd_model_config_inv_freq(const pd_model_config *c, float *inv_freq) {
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        // transformers: 1 / base ** (arange(0, dim, 2).float() / dim), in float32.
        float expo = (float)(2 * i) / (float)c->head_dim;
        float f = (float)(1.0 / pow(c->rope_theta, (double)expo));
        if (c->rope_type == PD_ROPE_LINEAR) {
            f = (float)(f / c->rope_factor);
        } else if (c->rope_type == PD_ROPE_LLAMA3) {
            double old = c->rope_original_max_position;
            double low_wl = old / c->rope_low_freq_factor, high_wl = old / c->rope_high_freq_factor;
            double wl = 2.0 * M_PI / f;
            double g = f;
            if (wl > low_wl) {
                g = f / c->rope_factor;
            } else if (wl >= high_wl) {  // medium band: interpolate
                double smooth = (old / wl - c->rope_low_freq_factor) / (c->rope_high_freq_factor - c->rope_low_freq_factor);
                g = (1 - smooth) * f / c->rope_factor + smooth * f;
            }
            f = (float)g;
        }
        inv_freq[i] = f;
    }
}

int64_t pd_model_config_n_params(const pd_model_config *c) {
    int64_t D = c->hidden_size, F = c->intermediate_size, V = c->vocab_size, hd = c->head_dim;
    int64_t qkv = D * hd * (c->n_heads + 2 * c->n_kv_heads) + (c->attention_bias ? hd * (c->n_heads + 2 * c->n_kv_heads) : 0);
    int64_t o = (int64_t)c->n_heads * hd * D;
    int64_t mlp = 3 * D * F + (c->mlp_bias ? 2 * F + D : 0);
    int64_t layer = qkv + o + mlp + 2 * D;
    return V * D * (c->tie_word_embeddings ? 1 : 2) + c->n_layers * layer + D;
}

size_t pd_model_config_kv_bytes_per_token(const pd_model_config *c, size_t elem) {
    return (size_t)2 * (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim * elem;
}

bool pd_model_config_is_eos(const pd_model_config *c, int id) {
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == id) return true;
    return false;
}
