// sample.cuh — launcher and parameters of the sampling kernel (logits → token ids on the device;
// see sample.cu). C-compatible: the CUDA backend shim (src/backend/cuda/sample.c) includes it.
// Pointers are device pointers; everything a row needs is in its pd_sample_krow, already
// normalised by the shim (1/temperature and logf(min_p) computed on the host, so both samplers
// use the same float values).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SAMPLE_KMAX_TOP 20
#define PD_SAMPLE_KMAX_VOCAB (1 << 30)
#define PD_SAMPLE_FAST_TOPP2 2 // pd_sample_kparams.fast: top-p rows without top-k read their chunk once
#define PD_SAMPLE_FAST_GATHER2 4 // pd_sample_kparams.fast: the two-level histogram gather
#define PD_SAMPLE_PENDING INT32_MIN // pd_sample_kout.token until the kernel has written the row (written last)
#define PD_SAMPLE_KINLINE 8   // rows carried in the launch's parameters (no copy) up to this batch

typedef struct pd_sample_krow {
    float inv_temp;       // 1 / temperature; unused when is_greedy
    float top_p;          // >= 1: off
    float log_min_p;      // logf(min_p); -INFINITY: off
    float presence, frequency, repetition;
    int32_t is_greedy;    // temperature == 0: argmax of the penalised logits
    int32_t top_k;        // 0: off (else 0 < top_k < vocab)
    int32_t n_logprobs;   // -1: none; 0..PD_SAMPLE_KMAX_TOP
    int32_t pen_begin, n_pens;
    int32_t mask_row;     // -1: no mask; else the row's bitmask in pd_sample_kparams.masks
    uint64_t seed, draw_idx;
} pd_sample_krow;

typedef struct pd_sample_kpen {
    int32_t token, count, is_seen;
    float bias;           // logit_bias after the penalties; <= -100: -inf
} pd_sample_kpen;

typedef struct pd_sample_kout {
    int32_t token;
    float logprob;
    int32_t n_top;
    int32_t top_ids[PD_SAMPLE_KMAX_TOP];
    float top_logprobs[PD_SAMPLE_KMAX_TOP];
} pd_sample_kout;

typedef struct pd_sample_kparams {
    float *logits;                 // (n_rows, vocab) f32: penalties applied in place, then restored
    const pd_sample_krow *rows;    // (n_rows); NULL: the rows are pd_cuda_sample's `in`
    const pd_sample_kpen *pens;    // (n_pens total), row r's at [pen_begin, pen_begin + n_pens)
    float *pen_raw;                // (n_pens total) scratch: the logits the penalties overwrote
    pd_sample_kout *out;           // (n_rows); may be mapped pinned host memory (written directly)
    const uint32_t *masks;         // (n_masks, mask_words) allowed-token bits; read, never written
    int n_rows, vocab, mask_words;
    int all_greedy;                // every row greedy (one pass: clusters only pay below 9 rows)
    int any_trunc;                 // some row has top-k or top-p (the candidate-set kernel)
    // Set by pd_cuda_sample, not by its caller (whatever the caller leaves there is overwritten):
    int fast;                      // candidate-set path on (PD_CUDA_SAMPLE_FAST=0: the radix passes only);
                                   // | PD_SAMPLE_FAST_TOPP2: the one-read top-p path too
    int topp_min_cl;               // top-p rows without top-k use it from this cluster size on
    int ecache;                    // capacity (floats) of each CTA's cache of exp(l - max); 0: none
} pd_sample_kparams;

// Up to PD_SAMPLE_KINLINE rows passed in the launch's parameters (no copy to the device first).
typedef struct pd_sample_kinline {
    pd_sample_krow rows[PD_SAMPLE_KINLINE];
} pd_sample_kinline;
// One thread-block cluster of 1-16 CTAs per row (sized to the batch; PD_CUDA_SAMPLE_CLUSTER forces
// it); no host synchronisation (graph-capturable).
// in: the rows when p->rows is NULL (p->n_rows <= PD_SAMPLE_KINLINE); else unused (may be NULL).
void pd_cuda_sample(const pd_sample_kparams *p, const pd_sample_kinline *in, cudaStream_t s);

#ifdef __cplusplus
}
#endif
