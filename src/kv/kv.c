// kv.c — the request-level KV manager (vLLM KVCacheManager): prefix lookup on admission, slot
// allocation as a request grows, caching of newly filled blocks, release on finish or preemption.
//
// A request's token history is append-only (prompt, then sampled tokens), so the chain hashes of
// its full blocks are computed once, kept in its pd_kv_seq, and stay valid across preemption: a
// re-admitted request looks up its prefix again without rehashing. Token layout of one request:
//
//   | block 0 | block 1 | ... | block k (partial) |
//   |<-- n_blocks_cached -->|<- allocated, being computed ->|
//   |<------------ n_tokens_computed ------------>|<- new ->|
//
// Only blocks entirely inside n_tokens_computed are ever cached, so a partial last block never is.
#include "base/buf.h"
#include "kv/kv_impl.h"

#include <string.h>

pd_kv_params pd_kv_params_default(void) {
    pd_kv_params p = {
        .n_blocks = 1024,
        .block_size = 16,
        .enable_prefix_caching = true,
        .n_events_max = 0,
        .hash_fn = NULL,
    };
    return p;
}

pd_kv_mgr *pd_kv_mgr_new(const pd_kv_params *p, pd_err *err) {
    if (!p || p->n_blocks <= 0 || p->block_size <= 0 || p->n_events_max < 0 ||
        p->n_blocks > (INT32_MAX - 1) / 2) {
        pd_err_set(err, PD_ERR_INVALID, "kv: bad params (n_blocks %d, block_size %d)",
                   p ? p->n_blocks : 0, p ? p->block_size : 0);
        return NULL;
    }
    size_t n_tok;
    if (pd_mul_overflow((size_t)p->n_blocks, (size_t)p->block_size, &n_tok) ||
        pd_mul_overflow(n_tok, sizeof(int32_t), &n_tok)) {
        pd_err_set(err, PD_ERR_INVALID, "kv: pool of %d x %d tokens is too large", p->n_blocks,
                   p->block_size);
        return NULL;
    }
    pd_kv_mgr *m = pd_calloc(1, sizeof *m);
    if (!m) goto fail;
    m->params = *p;
    m->hash_fn = p->hash_fn ? p->hash_fn : pd_hash_block;
    m->blocks = pd_calloc((size_t)p->n_blocks + 1, sizeof *m->blocks);
    if (!m->blocks) goto fail;
    if (p->enable_prefix_caching) {
        m->block_tokens = pd_malloc(n_tok);
        if (!m->block_tokens) goto fail;
        if (pd_kv_prefix_init(&m->prefix, p->n_blocks) != PD_OK) goto fail;
    }
    if (p->n_events_max > 0) {
        m->events = pd_calloc((size_t)p->n_events_max, sizeof *m->events);
        if (!m->events) goto fail;
    }
    for (int32_t i = 0; i < p->n_blocks; i++) m->blocks[i].parent_id = -1;
    pd_kv_freeq_init(&m->freeq, m->blocks, p->n_blocks);
    return m;
fail:
    pd_kv_mgr_free(m);
    pd_err_set(err, PD_ERR_NOMEM, "kv: out of memory for %d blocks", p->n_blocks);
    return NULL;
}

void pd_kv_mgr_free(pd_kv_mgr *m) {
    if (!m) return;
    pd_kv_prefix_fini(&m->prefix);
    pd_free(m->events);
    pd_free(m->block_tokens);
    pd_free(m->blocks);
    pd_free(m);
}

// ---- seq ------------------------------------------------------------------------------------------

void pd_kv_seq_init(pd_kv_seq *seq, uint64_t extra_key) {
    memset(seq, 0, sizeof *seq);
    seq->parent_id = -1;
    seq->root = pd_hash_root(extra_key);
}

void pd_kv_seq_fini(pd_kv_seq *seq) {
    PD_ASSERT(seq->n_blocks == 0);
    pd_free(seq->block_ids);
    pd_free(seq->block_hashes);
    pd_hash128 root = seq->root;
    memset(seq, 0, sizeof *seq);
    seq->parent_id = -1;
    seq->root = root;
}

// Extends the seq's chain hashes to cover the first n_full blocks of tokens.
static pd_status seq_hash_upto(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens, int32_t n_full) {
    if (n_full <= seq->n_hashes) return PD_OK;
    pd_status st = PD_ARRAY_RESERVE(seq->block_hashes, seq->cap_hashes, (size_t)n_full);
    if (st != PD_OK) return st;
    int32_t bs = m->params.block_size;
    for (int32_t i = seq->n_hashes; i < n_full; i++) {
        const pd_hash128 *parent = i == 0 ? &seq->root : &seq->block_hashes[i - 1];
        seq->block_hashes[i] = m->hash_fn(parent, tokens + (size_t)i * (size_t)bs, bs);
    }
    seq->n_hashes = n_full;
    return PD_OK;
}

// Walks the verified cached chain of tokens for at most max_blocks blocks. With touch, the hit
// blocks are appended to the (empty) seq and touched. Returns the number of hit blocks.
static int32_t walk_prefix(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens, int32_t max_blocks,
                           bool touch) {
    int32_t bs = m->params.block_size, parent_id = -1, n_hit = 0;
    uint32_t parent_gen = 0;
    for (int32_t i = 0; i < max_blocks; i++) {
        int32_t id = pd_kv_prefix_match(m, seq->block_hashes[i], tokens + (size_t)i * (size_t)bs,
                                        parent_id, parent_gen, seq->root, touch);
        if (id < 0) break;
        if (touch) {
            pd_kv_pool_touch(m, id);
            seq->block_ids[seq->n_blocks++] = id;
        }
        parent_id = id;
        parent_gen = m->blocks[id].gen;
        n_hit++;
    }
    if (touch) {
        seq->n_blocks_cached = n_hit;
        seq->parent_id = parent_id;
        seq->parent_gen = parent_gen;
    }
    return n_hit;
}

pd_status pd_kv_get_computed_blocks(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens,
                                    int32_t n_tokens, int32_t *out_n_hit_tokens) {
    *out_n_hit_tokens = 0;
    if (seq->n_blocks != 0 || n_tokens < 0) return PD_ERR_INVALID;
    seq->n_blocks_cached = 0;
    seq->parent_id = -1;
    if (!m->params.enable_prefix_caching || n_tokens == 0) return PD_OK;
    // NOTE: at least one token is always left to compute: a forward is needed for the logits.
    int32_t max_blocks = (n_tokens - 1) / m->params.block_size;
    pd_status st = seq_hash_upto(m, seq, tokens, max_blocks);
    if (st == PD_OK) st = PD_ARRAY_RESERVE(seq->block_ids, seq->cap_blocks, (size_t)max_blocks);
    if (st != PD_OK) return st;
    int32_t n_hit = walk_prefix(m, seq, tokens, max_blocks, true);
    m->stats.n_query_tokens += n_tokens;
    m->stats.n_hit_tokens += (int64_t)n_hit * m->params.block_size;
    m->stats.n_query_blocks += max_blocks;
    m->stats.n_hit_blocks += n_hit;
    *out_n_hit_tokens = n_hit * m->params.block_size;
    return PD_OK;
}

int32_t pd_kv_peek_computed(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens, int32_t n_tokens) {
    if (!m->params.enable_prefix_caching || n_tokens <= 0) return 0;
    int32_t max_blocks = (n_tokens - 1) / m->params.block_size;
    pd_status st = seq_hash_upto(m, seq, tokens, max_blocks);
    if (st != PD_OK) return st;
    return walk_prefix(m, seq, tokens, max_blocks, false) * m->params.block_size;
}

pd_status pd_kv_alloc_slots(pd_kv_mgr *m, pd_kv_seq *seq, int32_t n_tokens_computed,
                            int32_t n_new_tokens) {
    if (n_tokens_computed < 0 || n_new_tokens < 0 || n_tokens_computed > INT32_MAX - n_new_tokens)
        return PD_ERR_INVALID;
    int32_t need = pd_kv_n_blocks_for(m, n_tokens_computed + n_new_tokens) - seq->n_blocks;
    if (need <= 0) return PD_OK;
    if (need > m->freeq.n) return PD_NOSPACE;
    pd_status st = PD_ARRAY_RESERVE(seq->block_ids, seq->cap_blocks, (size_t)seq->n_blocks + (size_t)need);
    if (st != PD_OK) return st;
    for (int32_t i = 0; i < need; i++) {
        int32_t id = pd_kv_pool_alloc(m);
        PD_ASSERT(id >= 0);
        seq->block_ids[seq->n_blocks++] = id;
    }
    return PD_OK;
}

pd_status pd_kv_cache_full_blocks(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *tokens,
                                  int32_t n_tokens_computed) {
    if (!m->params.enable_prefix_caching) return PD_OK;
    int32_t bs = m->params.block_size, n_full = n_tokens_computed / bs;
    if (n_tokens_computed < 0 || n_full > seq->n_blocks) return PD_ERR_INVALID;
    if (n_full <= seq->n_blocks_cached) return PD_OK;
    pd_status st = seq_hash_upto(m, seq, tokens, n_full);
    if (st != PD_OK) return st;
    for (int32_t i = seq->n_blocks_cached; i < n_full; i++) {
        int32_t id = seq->block_ids[i];
        const int32_t *blk = tokens + (size_t)i * (size_t)bs;
        pd_hash128 h = seq->block_hashes[i];
        PD_ASSERT(!m->blocks[id].is_cached);  // only hit blocks are shared, and they are < cached
        int32_t existing = pd_kv_prefix_find(&m->prefix, h);
        int32_t canon = id;
        if (existing < 0) {
            pd_hash128 ph = i == 0 ? seq->root : seq->block_hashes[i - 1];
            pd_kv_pool_cache(m, id, h, ph, seq->parent_id, seq->parent_gen, blk);
        } else if (pd_kv_prefix_match(m, h, blk, seq->parent_id, seq->parent_gen, seq->root,
                                      true) == existing) {
            canon = existing;  // same content computed twice: chain on through the cached copy
        }
        // else: a different block owns this hash (collision); ours stays private, and so does the
        // rest of this chain, which hangs off a parent nobody can look up.
        seq->parent_id = canon;
        seq->parent_gen = m->blocks[canon].gen;
    }
    seq->n_blocks_cached = n_full;
    return PD_OK;
}

void pd_kv_free_request(pd_kv_mgr *m, pd_kv_seq *seq) {
    // NOTE: last block first, so the end of the sequence reaches the LRU head first.
    for (int32_t i = seq->n_blocks - 1; i >= 0; i--) pd_kv_pool_release(m, seq->block_ids[i]);
    seq->n_blocks = 0;
    seq->n_blocks_cached = 0;
    seq->parent_id = -1;
    seq->parent_gen = 0;
}

int32_t pd_kv_reset_prefix_cache(pd_kv_mgr *m) {
    if (!m->params.enable_prefix_caching) return 0;
    int32_t n = 0;
    for (int32_t i = 0; i < m->params.n_blocks; i++) {
        if (!m->blocks[i].is_cached) continue;
        pd_kv_pool_uncache(m, i, false);
        n++;
    }
    pd_kv_event ev = {.type = PD_KV_EVENT_ALL_CLEARED};
    pd_kv_pool_emit(m, &ev);
    return n;
}

int32_t pd_kv_events_drain(pd_kv_mgr *m, pd_kv_event *out, int32_t n_max) {
    int32_t n = 0;
    while (n < n_max && m->ev_n > 0) {
        out[n++] = m->events[m->ev_head];
        m->ev_head = (m->ev_head + 1) % m->params.n_events_max;
        m->ev_n--;
    }
    if (m->ev_n == 0) m->ev_head = 0;
    return n;
}

// ---- counters -------------------------------------------------------------------------------------

void pd_kv_stats_get(const pd_kv_mgr *m, pd_kv_stats *out) {
    *out = m->stats;
    out->n_blocks = m->params.n_blocks;
    out->n_free = m->freeq.n;
    out->n_used = m->params.n_blocks - m->freeq.n;
    out->n_cached = m->n_cached_free;
    out->n_cached_total = m->prefix.n;
}

int32_t pd_kv_n_blocks(const pd_kv_mgr *m) { return m->params.n_blocks; }
int32_t pd_kv_block_size(const pd_kv_mgr *m) { return m->params.block_size; }
int32_t pd_kv_n_free(const pd_kv_mgr *m) { return m->freeq.n; }
int32_t pd_kv_n_used(const pd_kv_mgr *m) { return m->params.n_blocks - m->freeq.n; }
int32_t pd_kv_n_cached(const pd_kv_mgr *m) { return m->n_cached_free; }
bool pd_kv_is_prefix_caching(const pd_kv_mgr *m) { return m->params.enable_prefix_caching; }

int32_t pd_kv_block_ref(const pd_kv_mgr *m, int32_t block_id) {
    if (block_id < 0 || block_id >= m->params.n_blocks) return -1;
    return m->blocks[block_id].ref;
}
