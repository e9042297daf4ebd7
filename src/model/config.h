// config — the model's hyper-parameters, read from a Hugging Face `config.json` (and the EOS ids
// of `generation_config.json`). Supports LlamaForCausalLM, MistralForCausalLM and
// Qwen2ForCausalLM: grouped-query attention, qkv bias (`attention_bias`, always on for Qwen2),
// tied embeddings, `rope_theta`, `rope_scaling` of type llama3 and linear, `head_dim` when given.
// Unknown architectures and rope types are refused with a message naming them.
#pragma once
#include "backend/backend.h"
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_arch {
    PD_ARCH_LLAMA = 0,
    PD_ARCH_MISTRAL = 1,
    PD_ARCH_QWEN2 = 2,
} pd_arch;

typedef enum pd_rope_type {
    PD_ROPE_DEFAULT = 0,
    PD_ROPE_LINEAR = 1,
    PD_ROPE_LLAMA3 = 2,
} pd_rope_type;

#define PD_MAX_EOS 8

typedef struct pd_model_config {
    pd_arch arch;
    char arch_name[64];  // "LlamaForCausalLM", ...
    int vocab_size, hidden_size, intermediate_size;
    int n_layers, n_heads, n_kv_heads, head_dim;
    int max_position_embeddings;
    float rms_norm_eps;
    double rope_theta;
    pd_rope_type rope_type;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_position;
    bool tie_word_embeddings;
    bool attention_bias;  // q/k/v projections have biases (Qwen2 always)
    bool mlp_bias;
    int sliding_window;   // 0 = none (recorded; full attention is used)
    int bos_token_id;     // -1 if none
    int eos_token_ids[PD_MAX_EOS];
    int n_eos;
    pd_dtype torch_dtype;
} pd_model_config;

// Parses config.json text. err names the missing/invalid field.
pd_status pd_model_config_parse(const char *json, size_t len, pd_model_config *out, pd_err *err);
// Reads dir/config.json, then merges eos ids from dir/generation_config.json if present.
pd_status pd_model_config_load(const char *dir, pd_model_config *out, pd_err *err);
// RoPE inverse frequencies (head_dim/2 floats) with the config's scaling applied, as transformers
// computes them.
void pd_model_config_inv_freq(const pd_model_config *c, float *inv_freq);
// Parameter count of the model described (embeddings and lm_head counted once if tied).
int64_t pd_model_config_n_params(const pd_model_config *c);
// KV-cache bytes per token for a given element size.
size_t pd_model_config_kv_bytes_per_token(const pd_model_config *c, size_t elem_size);
bool pd_model_config_is_eos(const pd_model_config *c, int token_id);

#ifdef __cplusplus
}
#endif
