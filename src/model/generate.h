// generate — a small offline driver over pd_model: runs several sequences to completion in one
// batch (prefill in chunks, then one decode step per token for all live sequences), each with its
// own sampler. It is what `pdserve generate` and the golden tests use; the serving engine has its
// own scheduler and does not use this. Blocks are handed out from a (optionally shuffled) list so
// the paged layout is exercised as it is under the engine.
#pragma once
#include "model/model.h"
#include "model/sample.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_gen_finish {
    PD_GEN_FINISH_NONE = 0,
    PD_GEN_FINISH_LENGTH = 1,  // max_tokens reached
    PD_GEN_FINISH_STOP = 2,    // EOS / stop id / stop string
    PD_GEN_FINISH_ABORT = 3,
} pd_gen_finish;

// Called after each sampled token; return true to stop that sequence (e.g. a stop string matched).
typedef bool (*pd_gen_token_fn)(void *ud, int seq_idx, const pd_sample_result *r);

typedef struct pd_gen_seq {
    const int32_t *prompt;  // borrowed (n_prompt)
    int n_prompt;
    int max_tokens;
    bool ignore_eos;         // do not stop on the model's EOS ids
    const int32_t *stop_ids; // borrowed (n_stop_ids) extra stop token ids
    int n_stop_ids;
    pd_sampling_params sampling;
    // outputs
    int32_t *out_ids;        // caller-owned, capacity max_tokens
    int n_out;
    pd_gen_finish finish;
} pd_gen_seq;

typedef struct pd_gen_params {
    int block_size;          // KV block size (default 16)
    int prefill_chunk;       // max tokens per prefill step across sequences (default 512)
    uint64_t block_shuffle_seed;  // 0: blocks in order; else a seeded permutation
    pd_gen_token_fn on_token;     // (optional)
    void *ud;
} pd_gen_params;
pd_gen_params pd_gen_params_default(void);

// Runs all sequences. Allocates a KV cache sized for them. PD_ERR_INVALID for a prompt that is
// empty or longer than the context; err says which.
pd_status pd_generate(pd_model *m, pd_gen_seq *seqs, int n_seqs, const pd_gen_params *gp, pd_err *err);

#ifdef __cplusplus
}
#endif
