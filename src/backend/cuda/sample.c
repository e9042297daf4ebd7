// sample.c — the CUDA shim of pd_op_sample (kernel: src/kernels/sample.cu).
//
// Per call: the rows' parameters (normalised here: 1/temperature, logf(min_p), top_k clamped to
// "off"), the penalty / logit-bias entries and the token masks of constrained rows are packed into
// a pinned staging buffer; one kernel launch samples every row and writes the n_rows results
// straight into that (mapped) pinned buffer; the stream is synchronised. Up to PD_SAMPLE_KINLINE
// rows without penalties or masks travel in the launch's own parameters, so such a call (every
// plain decode step of a small batch) is one launch and one synchronisation: no copy either way.
// Otherwise rows, penalties and masks go up in one host-to-device copy before the launch.
// PD_CUDA_SAMPLE_DIRECT=0 restores the copies both ways (rows up, results down), for A/B runs.
// With results in mapped memory, the shim waits for them rather than for the stream: the kernel
// writes each row's token last (after a system fence; PD_SAMPLE_PENDING until then) and the host
// spins on those tokens, checking the stream now and then (a failed or finished kernel without
// results is an error, never a hang). The kernel may still be retiring when the op returns; work
// queued after it on the stream is ordered as before. PD_CUDA_SAMPLE_POLL=0: stream synchronize.
// The staging buffers (pinned host, device) belong to the backend and only grow; they are never
// used inside a captured graph, so growing them does not bump the backend's scratch generation.
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_impl.h"
#include "kernels/sample.cuh"

_Static_assert(PD_SAMPLE_KMAX_TOP == PD_SAMPLE_MAX_TOP, "kernel and backend top-N bounds differ");
_Static_assert(sizeof(pd_sample_kout) == sizeof(pd_sample_out), "pd_sample_kout and pd_sample_out differ");

struct pd_cuda_sampler {
    void *host;  // pinned, mapped: [krows | kpens | masks] to send, [kouts] received
    void *host_dev;  // the device's address of host (the kernel writes the results there)
    size_t host_bytes;
    void *dev;   // [krows | kpens | masks | pen_raw | kouts]
    size_t dev_bytes;
};

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

void pd_cuda_sample_fini(pd_cuda_backend *cb) {
    pd_cuda_sampler *s = cb->sampler;
    if (!s) return;
    if (s->host) cudaFreeHost(s->host);
    if (s->dev) cudaFree(s->dev);
    pd_free(s);
    cb->sampler = NULL;
}

// Grows the staging buffers to at least host_need / dev_need bytes (the stream is idle between
// calls: every call ends with a synchronisation; the device one is a backend scratch).
static pd_cuda_sampler *sampler_reserve(pd_cuda_backend *cb, size_t host_need, size_t dev_need) {
    if (!cb->sampler) {
        cb->sampler = pd_calloc(1, sizeof(pd_cuda_sampler));
        PD_ASSERT(cb->sampler);
    }
    pd_cuda_sampler *s = cb->sampler;
    if (host_need > s->host_bytes) {
        PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));  // a polled call's kernel may still be retiring
        if (s->host) PD_CUDA_CHECK(cudaFreeHost(s->host));
        s->host = NULL;
        size_t n = host_need + host_need / 2;
        PD_CUDA_CHECK(cudaHostAlloc(&s->host, n, cudaHostAllocMapped));
        PD_CUDA_CHECK(cudaHostGetDevicePointer(&s->host_dev, s->host, 0));
        s->host_bytes = n;
    }
    pd_cuda_scratch_reserve(cb, &s->dev, &s->dev_bytes, dev_need, false);  // never in a graph
    return s;
}

static pd_sample_krow krow_of(const pd_sample_row *r, int vocab, int n_pens, int n_masks) {
    PD_ASSERT(r->temperature >= 0 && r->n_logprobs >= -1 && r->n_logprobs <= PD_SAMPLE_MAX_TOP);
    PD_ASSERT(r->mask_row >= -1 && r->mask_row < n_masks);
    PD_ASSERT(r->n_pens >= 0 && r->pen_begin >= 0 && r->pen_begin + r->n_pens <= n_pens);
    pd_sample_krow k = {0};
    k.is_greedy = r->temperature == 0.0f;
    k.inv_temp = k.is_greedy ? 1.0f : 1.0f / r->temperature;  // the CPU sampler's float, bit for bit
    k.top_k = r->top_k > 0 && r->top_k < vocab ? r->top_k : 0;
    k.top_p = r->top_p;
    k.log_min_p = r->min_p > 0 ? logf(r->min_p) : -INFINITY;
    k.presence = r->presence_penalty;
    k.frequency = r->frequency_penalty;
    k.repetition = r->repetition_penalty;
    k.n_logprobs = r->n_logprobs;
    k.pen_begin = r->pen_begin;
    k.n_pens = r->n_pens;
    k.mask_row = r->mask_row;
    k.seed = r->seed;
    k.draw_idx = r->draw_idx;
    return k;
}

// Waits until the kernel has written every row's token into mapped memory (see the top).
static void wait_results(pd_cuda_backend *cb, pd_sample_kout *outs, int n_rows) {
    for (uint64_t spin = 0;; spin++) {
        int r = 0;
        while (r < n_rows && __atomic_load_n(&outs[r].token, __ATOMIC_ACQUIRE) != PD_SAMPLE_PENDING) r++;
        if (r == n_rows) return;
        if ((spin & 255) == 255) {  // every ~256 looks: has the kernel ended (or failed) without them?
            cudaError_t e = cudaStreamQuery(cb->stream);
            if (e == cudaErrorNotReady) continue;
            PD_CUDA_CHECK(e);
            for (r = 0; r < n_rows; r++)
                if (__atomic_load_n(&outs[r].token, __ATOMIC_ACQUIRE) == PD_SAMPLE_PENDING)
                    pd_abort(__FILE__, __LINE__, __func__, "the sampling kernel ended without writing every row");
            return;
        }
    }
}

void pd_cuda_sample_op(pd_backend *b, const pd_sample_params *p) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    PD_ASSERT(p->logits && p->rows && p->out && p->n_rows > 0 && p->vocab > 0 && p->vocab <= PD_SAMPLE_KMAX_VOCAB);
    PD_ASSERT(p->n_pens >= 0 && (p->n_pens == 0 || p->pens));
    size_t rows_b = align16(sizeof(pd_sample_krow) * (size_t)p->n_rows);
    size_t pens_b = align16(sizeof(pd_sample_kpen) * (size_t)p->n_pens);
    size_t raw_b = align16(sizeof(float) * (size_t)p->n_pens);
    size_t outs_b = align16(sizeof(pd_sample_kout) * (size_t)p->n_rows);
    int n_masks = p->masks ? p->n_masks : 0;
    PD_ASSERT(n_masks == 0 || p->mask_words == (p->vocab + 31) / 32);
    size_t masks_b = align16(sizeof(uint32_t) * (size_t)n_masks * (size_t)(n_masks ? p->mask_words : 0));
    size_t send_b = rows_b + pens_b + masks_b;
    pd_cuda_sampler *s = sampler_reserve(cb, send_b + outs_b, send_b + raw_b + outs_b);
    char *h = s->host, *d = s->dev;
    pd_sample_krow *hrows = (pd_sample_krow *)h;
    pd_sample_kpen *hpens = (pd_sample_kpen *)(h + rows_b);
    pd_sample_kout *houts = (pd_sample_kout *)(h + send_b);
    int all_greedy = 1, any_trunc = 0;
    for (int r = 0; r < p->n_rows; r++) {
        hrows[r] = krow_of(&p->rows[r], p->vocab, p->n_pens, n_masks);
        all_greedy &= hrows[r].is_greedy;
        any_trunc |= !hrows[r].is_greedy && (hrows[r].top_k > 0 || hrows[r].top_p < 1.0f);
    }
    for (int i = 0; i < p->n_pens; i++) {
        PD_ASSERT(p->pens[i].token >= 0 && p->pens[i].token < p->vocab);
        hpens[i] = (pd_sample_kpen){.token = p->pens[i].token, .count = p->pens[i].count, .is_seen = p->pens[i].is_seen,
                                    .bias = p->pens[i].bias};
    }
    if (n_masks) memcpy(h + rows_b + pens_b, p->masks, sizeof(uint32_t) * (size_t)n_masks * (size_t)p->mask_words);
    const char *env = getenv("PD_CUDA_SAMPLE_DIRECT");  // read per call: tests and A/B runs flip it
    bool direct = !(env && !strcmp(env, "0"));
    bool inline_rows = direct && p->n_pens == 0 && n_masks == 0 && p->n_rows <= PD_SAMPLE_KINLINE;
    if (!inline_rows) PD_CUDA_CHECK(cudaMemcpyAsync(d, h, send_b, cudaMemcpyHostToDevice, cb->stream));
    pd_sample_kparams k = {.logits = p->logits, .rows = inline_rows ? NULL : (const pd_sample_krow *)d,
                           .pens = (const pd_sample_kpen *)(d + rows_b), .pen_raw = (float *)(d + send_b),
                           .out = direct ? (pd_sample_kout *)((char *)s->host_dev + send_b)
                                         : (pd_sample_kout *)(d + send_b + raw_b),
                           .n_rows = p->n_rows, .vocab = p->vocab,
                           .masks = n_masks ? (const uint32_t *)(d + rows_b + pens_b) : NULL,
                           .mask_words = p->mask_words, .all_greedy = all_greedy, .any_trunc = any_trunc};
    env = getenv("PD_CUDA_SAMPLE_POLL");
    bool poll = direct && !(env && !strcmp(env, "0"));
    if (poll)
        for (int r = 0; r < p->n_rows; r++) __atomic_store_n(&houts[r].token, PD_SAMPLE_PENDING, __ATOMIC_RELAXED);
    pd_sample_kinline in;
    if (inline_rows) {
        memset(&in, 0, sizeof in);  // the slots past n_rows are never read, but travel
        memcpy(in.rows, hrows, sizeof(pd_sample_krow) * (size_t)p->n_rows);
    }
    pd_cuda_sample(&k, inline_rows ? &in : NULL, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
    if (!direct)
        PD_CUDA_CHECK(cudaMemcpyAsync(houts, k.out, sizeof(pd_sample_kout) * (size_t)p->n_rows, cudaMemcpyDeviceToHost,
                                      cb->stream));
    if (poll) wait_results(cb, houts, p->n_rows);
    else PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));
    for (int r = 0; r < p->n_rows; r++) {
        pd_sample_out *o = &p->out[r];
        o->token = houts[r].token;
        o->logprob = houts[r].logprob;
        o->n_top = houts[r].n_top;
        memcpy(o->top_ids, houts[r].top_ids, sizeof o->top_ids);
        memcpy(o->top_logprobs, houts[r].top_logprobs, sizeof o->top_logprobs);
    }
}
