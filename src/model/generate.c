// generate.c — see generate.h.
#include "model/generate.h"

#include <string.h>

pd_gen_params pd_gen_params_default(void) {
    pd_gen_params p = {0};
    p.block_size = 16;
    p.prefill_chunk = 512;
    return p;
}

typedef struct gen_state {
    int n_computed;   // tokens whose KV is in the cache
    int n_total;      // prompt + generated so far
    int32_t *tokens;  // prompt then generated (owned)
    pd_sampler *sampler;
    bool done;
    int blk0;         // offset into the block list
} gen_state;

static bool is_stop(const pd_model_config *c, const pd_gen_seq *s, int32_t t) {
    if (!s->ignore_eos && pd_model_config_is_eos(c, t)) return true;
    for (int i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] == t) return true;
    return false;
}

// Builds and runs one step over `n_sel` sequences whose next tokens are [n_computed, n_computed+q).
static pd_status step(pd_model *m, pd_model_cache *kc, pd_gen_seq *seqs, gen_state *gs, const int *sel, const int *q,
                      int n_sel, const int32_t *blocks, int blocks_per_seq, const pd_gen_params *gp, float *logits) {
    const pd_model_config *c = pd_model_get_config(m);
    int T = 0;
    for (int i = 0; i < n_sel; i++) T += q[i];
    int32_t *tok = pd_malloc(sizeof(int32_t) * (size_t)T), *qi = pd_malloc(sizeof(int32_t) * (size_t)(n_sel + 1));
    int32_t *kvl = pd_malloc(sizeof(int32_t) * (size_t)n_sel), *bti = pd_malloc(sizeof(int32_t) * (size_t)(n_sel + 1));
    int32_t *bt = pd_malloc(sizeof(int32_t) * (size_t)(n_sel * blocks_per_seq)), *rows = pd_malloc(sizeof(int32_t) * (size_t)n_sel);
    pd_status st = PD_ERR_NOMEM;
    if (!tok || !qi || !kvl || !bti || !bt || !rows) goto out;
    int t = 0, n_logits = 0;
    qi[0] = bti[0] = 0;
    for (int i = 0; i < n_sel; i++) {
        gen_state *g = &gs[sel[i]];
        memcpy(tok + t, g->tokens + g->n_computed, sizeof(int32_t) * (size_t)q[i]);
        t += q[i];
        qi[i + 1] = t;
        kvl[i] = g->n_computed + q[i];
        int nb = (kvl[i] + gp->block_size - 1) / gp->block_size;
        memcpy(bt + bti[i], blocks + g->blk0, sizeof(int32_t) * (size_t)nb);
        bti[i + 1] = bti[i] + nb;
        if (kvl[i] == g->n_total) rows[n_logits++] = t - 1;  // reached the end: sample
    }
    pd_batch b = {.n_tokens = T, .tokens = tok, .n_seqs = n_sel, .q_indptr = qi, .kv_lens = kvl, .bt_indptr = bti,
                  .bt_indices = bt, .n_logits = n_logits, .logit_rows = rows};
    st = pd_model_forward(m, kc, &b, logits);
    if (st) goto out;
    int li = 0;
    for (int i = 0; i < n_sel; i++) {
        int si = sel[i];
        gen_state *g = &gs[si];
        pd_gen_seq *s = &seqs[si];
        g->n_computed += q[i];
        if (g->n_computed != g->n_total) continue;
        float *row = logits + (size_t)li++ * (size_t)c->vocab_size;
        pd_sample_result r;
        int32_t tk = pd_sampler_sample(g->sampler, row, &r);
        pd_sampler_accept(g->sampler, tk);
        s->out_ids[s->n_out++] = tk;
        g->tokens[g->n_total++] = tk;
        bool stop = gp->on_token && gp->on_token(gp->ud, si, &r);
        if (stop || is_stop(c, s, tk)) {
            s->finish = PD_GEN_FINISH_STOP;
            g->done = true;
        } else if (s->n_out >= s->max_tokens) {
            s->finish = PD_GEN_FINISH_LENGTH;
            g->done = true;
        }
    }
out:
    pd_free(tok), pd_free(qi), pd_free(kvl), pd_free(bti), pd_free(bt), pd_free(rows);
    return st;
}

pd_status pd_generate(pd_model *m, pd_gen_seq *seqs, int n_seqs, const pd_gen_params *gp, pd_err *err) {
    const pd_model_config *c = pd_model_get_config(m);
    int bs = gp->block_size, max_len = 0;
    for (int i = 0; i < n_seqs; i++) {
        seqs[i].n_out = 0;
        seqs[i].finish = PD_GEN_FINISH_NONE;
        if (seqs[i].n_prompt <= 0) return pd_err_set(err, PD_ERR_INVALID, "sequence %d: empty prompt", i);
        if (seqs[i].max_tokens < 0) return pd_err_set(err, PD_ERR_INVALID, "sequence %d: max_tokens must be >= 0", i);
        int len = seqs[i].n_prompt + seqs[i].max_tokens;
        if (len > c->max_position_embeddings)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d: prompt (%d) + max_tokens (%d) exceeds the context length %d", i,
                              seqs[i].n_prompt, seqs[i].max_tokens, c->max_position_embeddings);
        max_len = PD_MAX(max_len, len);
    }
    int bps = (max_len + bs - 1) / bs, n_blocks = bps * n_seqs;
    pd_model_cache *kc = pd_model_cache_new(m, n_blocks, bs, err);
    if (!kc) return err ? err->status : PD_ERR_DEVICE;
    gen_state *gs = pd_calloc((size_t)n_seqs, sizeof *gs);
    int32_t *blocks = pd_malloc(sizeof(int32_t) * (size_t)n_blocks);
    int *sel = pd_malloc(sizeof(int) * (size_t)n_seqs), *q = pd_malloc(sizeof(int) * (size_t)n_seqs);
    float *logits = pd_malloc(sizeof(float) * (size_t)n_seqs * (size_t)c->vocab_size);
    pd_status st = PD_ERR_NOMEM;
    if (!gs || !blocks || !sel || !q || !logits) goto out;
    for (int i = 0; i < n_blocks; i++) blocks[i] = i;
    if (gp->block_shuffle_seed) {
        pd_rng r;
        pd_rng_seed(&r, gp->block_shuffle_seed);
        for (int i = n_blocks - 1; i > 0; i--) {
            int j = (int)(pd_rng_next(&r) % (uint64_t)(i + 1));
            int32_t t = blocks[i];
            blocks[i] = blocks[j];
            blocks[j] = t;
        }
    }
    for (int i = 0; i < n_seqs; i++) {
        gen_state *g = &gs[i];
        g->tokens = pd_malloc(sizeof(int32_t) * (size_t)(seqs[i].n_prompt + seqs[i].max_tokens + 1));
        g->sampler = pd_sampler_new(&seqs[i].sampling, c->vocab_size);
        if (!g->tokens || !g->sampler) goto out;
        memcpy(g->tokens, seqs[i].prompt, sizeof(int32_t) * (size_t)seqs[i].n_prompt);
        g->n_total = seqs[i].n_prompt;
        g->blk0 = i * bps;
        g->done = seqs[i].max_tokens == 0;
        if (g->done) seqs[i].finish = PD_GEN_FINISH_LENGTH;
        pd_sampler_add_prompt(g->sampler, seqs[i].prompt, seqs[i].n_prompt);
    }
    for (;;) {
        // Prefill first (chunks of up to prefill_chunk tokens in total), then decodes.
        int n_sel = 0, budget = gp->prefill_chunk > 0 ? gp->prefill_chunk : 1 << 30;
        for (int i = 0; i < n_seqs && budget > 0; i++) {
            gen_state *g = &gs[i];
            int left = g->n_total - g->n_computed;
            if (g->done || (left <= 1 && g->n_computed > 0)) continue;
            int take = PD_MIN(left, budget);
            sel[n_sel] = i;
            q[n_sel++] = take;
            budget -= take;
        }
        if (n_sel == 0) {
            for (int i = 0; i < n_seqs; i++)
                if (!gs[i].done) {
                    sel[n_sel] = i;
                    q[n_sel++] = gs[i].n_total - gs[i].n_computed;
                }
        }
        if (n_sel == 0) break;
        st = step(m, kc, seqs, gs, sel, q, n_sel, blocks, bps, gp, logits);
        if (st) {
            pd_err_set(err, st, "forward failed: %s", pd_status_str(st));
            goto out;
        }
    }
    st = PD_OK;
out:
    if (gs)
        for (int i = 0; i < n_seqs; i++) {
            pd_free(gs[i].tokens);
            pd_sampler_free(gs[i].sampler);
        }
    pd_free(gs), pd_free(blocks), pd_free(sel), pd_free(q), pd_free(logits);
    pd_model_cache_free(kc);
    if (st == PD_ERR_NOMEM && err && !err->msg[0]) pd_err_set(err, st, "out of memory");
    return st;
}
