// engine.c — the step loop. One engine thread owns the backend, the model, the KV cache (device
// memory), the block manager (kv/) and the scheduler (sched/). Per step:
//
//   drain commands ─► pd_sched_schedule ─► build pd_batch ─► pd_model_forward ─► sample rows
//        ▲                                                                          │
//        └───────── push TOKEN / FINISHED events ◄──── pd_sched_update ◄────────────┘
//
// Per-request state the scheduler does not keep (the sampler with its RNG and penalty counts) lives
// in a small id → request table here. Step buffers grow to the largest step and are reused, so a
// warm engine does not allocate per step except in the sampler's logprob path. Sampling runs on
// the device when the backend has the op (only token ids cross to the host), else on host threads.
#include "engine/engine.h"

#include <limits.h>
#include <omp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>
#include <xxhash.h>

#include "engine/engine_impl.h"

pd_engine_params pd_engine_params_default(void) {
    pd_engine_params p = {0};
    p.device = "auto";
    p.block_size = 16;
    p.memory_utilization = 0.9f;
    p.max_num_batched_tokens = 2048;
    p.enable_prefix_caching = true;
    p.enable_chunked_prefill = true;
    p.max_waiting = 4096;
    p.disagg_min_tokens = 64;
    p.disagg_link_aware = false;
    p.disagg_timeout_ms = 30000;
    return p;
}

// ---- request table -----------------------------------------------------------------------------
// A pd_map (base/map.h) of {id, ereq *}; ids are mixed because clients use sequential ones.
typedef struct req_entry {
    uint64_t id;
    ereq *q;
} req_entry;
static ereq *req_find(pd_engine *e, uint64_t id) {
    const req_entry *en = pd_map_find(&e->reqs, pd_map_mix64(id), &id);
    return en ? en->q : NULL;
}
static void req_remove(pd_engine *e, uint64_t id) {
    ereq *r = req_find(e, id);
    if (!r) return;
    pd_map_del(&e->reqs, pd_map_mix64(id), &id);
    pd_sampler_free(r->sampler);
    pd_engine_spec_req_fini(r);
    pd_disagg_req_fini(r);
    pd_tiers_req_fini(r);
    pd_free(r);
}
ereq *pd_engine_req_find(pd_engine *e, uint64_t id) { return req_find(e, id); }
pd_status pd_engine_req_reserve(pd_engine *e) { return pd_map_reserve(&e->reqs, pd_map_len(&e->reqs) + 1); }
void pd_engine_req_insert(pd_engine *e, ereq *q) {
    bool existed;
    req_entry *en = pd_map_put(&e->reqs, pd_map_mix64(q->id), &q->id, &existed);
    PD_ASSERT(en && !existed);  // reserved by pd_engine_req_reserve; ids are unique
    en->q = q;
}
size_t pd_engine_req_cap(const pd_engine *e) { return e->reqs.cap; }
ereq *pd_engine_req_at(const pd_engine *e, size_t i) {
    const req_entry *en = pd_map_slot(&e->reqs, i);
    return en ? en->q : NULL;
}
void pd_engine_req_remove(pd_engine *e, uint64_t id) { req_remove(e, id); }

const char *pd_engine_role_name(pd_engine_role r) {
    return r == PD_ROLE_PREFILL ? "prefill" : r == PD_ROLE_DECODE ? "decode" : "both";
}

// ---- construction ------------------------------------------------------------------------------
static int size_kv_blocks(pd_engine *e, pd_err *err) {
    const pd_engine_params *p = &e->params;
    if (p->n_blocks > 0) return p->n_blocks;
    const pd_model_config *c = pd_model_get_config(e->model);
    size_t per_block = 2 * (size_t)c->n_layers * pd_model_kv_row_bytes(e->model) * (size_t)p->block_size;
    per_block += pd_engine_spec_kv_bytes_per_block(e);  // a draft model's cache has as many blocks
    size_t budget = p->kv_cache_bytes;
    size_t n_need = SIZE_MAX;  // blocks the limits can use at most (CPU default only)
    if (!budget) {
        size_t free_b = 0, total_b = 0;
        pd_backend_mem_info(e->backend, &free_b, &total_b);
        budget = (size_t)((double)free_b * p->memory_utilization);
        if (!strcmp(pd_backend_name(e->backend), "cpu")) {
            // On the CPU the "device" is the host, shared with everything else on it (a `pdserve
            // run` puts two workers and a router there): hold what the limits can use, and at most
            // 1/32 of the host's memory or 512 MiB. A decode (or colocated) worker can have
            // max_num_seqs full contexts; a prefill worker holds prompts only while it computes and
            // exports them: two steps' worth plus one full context. The pool is zeroed at start,
            // so all of it is resident memory.
            size_t cap = PD_MIN(total_b / 32, (size_t)512 << 20);
            if (budget > cap) budget = cap;
            size_t per_ctx = (size_t)(e->max_model_len + p->block_size - 1) / (size_t)p->block_size;
            int seqs = p->max_num_seqs > 0 ? p->max_num_seqs : 64;
            int step = p->max_num_batched_tokens > 0 ? p->max_num_batched_tokens : 2048;
            n_need = p->role == PD_ROLE_PREFILL
                         ? per_ctx + (size_t)(2 * step + p->block_size - 1) / (size_t)p->block_size
                         : (size_t)seqs * per_ctx;
        }
    }
    size_t n = budget / per_block;
    if (n > n_need) n = n_need;
    if (n < 2) {
        pd_err_set(err, PD_ERR_DEVICE, "KV cache budget of %zu bytes holds fewer than 2 blocks of %zu bytes", budget, per_block);
        return -1;
    }
    return n > (1u << 30) ? 1 << 30 : (int)n;
}

pd_engine *pd_engine_new(const pd_engine_params *p, pd_err *err) {
    pd_engine *e = pd_calloc(1, sizeof *e);
    if (!e) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    e->params = *p;
    if (e->params.block_size <= 0) e->params.block_size = 16;
    const char *base = strrchr(p->model_dir, '/');
    snprintf(e->model_name, sizeof e->model_name, "%s", base && base[1] ? base + 1 : p->model_dir);
    if (pd_map_init(&e->reqs, &(pd_map_params){.entry_size = sizeof(req_entry), .key_size = 8})) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (pd_queue_init(&e->q)) {
        pd_err_set(err, PD_ERR_IO, "cannot create the engine's event fd");
        goto fail;
    }
    if (p->n_threads > 0) omp_set_num_threads(p->n_threads);  // this thread (load, warm-up)
    e->backend = pd_backend_new(p->device, p->device_id, err);
    if (!e->backend) goto fail;
    e->tok = pd_tok_load(p->model_dir, err);
    if (!e->tok) goto fail;
    pd_model_params mp = pd_model_params_default();
    mp.dir = p->model_dir;
    mp.backend = e->backend;
    mp.dummy = p->dummy_weights;
    mp.dummy_num_layers = p->dummy_num_layers;
    mp.dummy_scale_from = p->dummy_scale_from;
    mp.dummy_scale_eps = p->dummy_scale_eps;
    mp.kv_dtype = p->kv_cache_dtype;
    e->model = pd_model_load(&mp, err);
    if (!e->model) goto fail;
    if (pd_engine_spec_load(e, err)) goto fail;  // a draft model's weights, before the KV is sized
    const pd_model_config *c = pd_model_get_config(e->model);
    e->max_model_len = p->max_model_len > 0 ? PD_MIN(p->max_model_len, c->max_position_embeddings) : c->max_position_embeddings;
    int n_blocks = size_kv_blocks(e, err);
    if (n_blocks < 0) goto fail;
    if (!e->params.kv_transport)
        e->params.kv_transport = !strcmp(pd_backend_name(e->backend), "cpu") ? PD_KVW_TRANSPORT_SHM : PD_KVW_TRANSPORT_CUDA_IPC;
    // A decode worker's pool is exported once so prefill workers can write straight into it.
    bool shared = p->role == PD_ROLE_DECODE && e->params.kv_transport != PD_KVW_TRANSPORT_TCP;
    e->cache = shared ? pd_model_cache_new_shared(e->model, n_blocks, e->params.block_size, err)
                      : pd_model_cache_new(e->model, n_blocks, e->params.block_size, err);
    if (!e->cache) goto fail;
    e->layer_k = pd_malloc(sizeof(void *) * (size_t)c->n_layers);
    e->layer_v = pd_malloc(sizeof(void *) * (size_t)c->n_layers);
    if (!e->layer_k || !e->layer_v) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int l = 0; l < c->n_layers; l++) {
        e->layer_k[l] = pd_model_cache_k(e->cache, l);
        e->layer_v[l] = pd_model_cache_v(e->cache, l);
    }
    pd_kv_params kp = pd_kv_params_default();
    kp.n_blocks = n_blocks;
    kp.block_size = e->params.block_size;
    kp.enable_prefix_caching = p->enable_prefix_caching;
    kp.n_events_max = 1 << 16;
    e->kv_log = pd_wire_kv_log_new(1 << 16);
    if (!e->kv_log) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    e->instance = XXH3_64bits_withSeed(&e, sizeof e, (uint64_t)pd_time_us() ^ ((uint64_t)getpid() << 32));
    e->ema_prefill_tps = e->ema_decode_ms = -1;
    e->kv = pd_kv_mgr_new(&kp, err);
    if (!e->kv) goto fail;
    pd_sched_params sp = pd_sched_params_default();
    if (p->max_num_seqs > 0) sp.max_num_seqs = p->max_num_seqs;
    else sp.max_num_seqs = !strcmp(pd_backend_name(e->backend), "cpu") ? 64 : 256;
    e->max_num_seqs = sp.max_num_seqs;  // the value in force (reported to the router)
    sp.max_num_batched_tokens = p->max_num_batched_tokens > 0 ? p->max_num_batched_tokens : 2048;
    sp.enable_chunked_prefill = p->enable_chunked_prefill;
    sp.max_model_len = e->max_model_len;
    sp.policy = p->policy == PD_POLICY_SRPT ? PD_SCHED_SRPT : PD_SCHED_FCFS;
    // Admission knobs for measurements (docs/design.md "kv and sched"): PDSERVE_SCHED_BACKFILL=1
    // turns backfill on, PDSERVE_TIER_RESERVE=0 makes a tier load reserve only its loaded blocks.
    if (pd_env_switch("PDSERVE_SCHED_BACKFILL", sp.backfill, &sp.backfill, err) ||
        pd_env_switch("PDSERVE_TIER_RESERVE", sp.tier_reserve_compute, &sp.tier_reserve_compute, err))
        goto fail;
    if (pd_engine_spec_init(e, &sp, err)) goto fail;  // the draft's KV cache, lookahead slots
    e->sched = pd_sched_new(&sp, e->kv, err);
    if (!e->sched) goto fail;
    // Decode graphs (GPU) are captured now, with the workspace sized for the largest step: lazily,
    // the first step of each (batch, context) bucket paid a capture (~40 ms on an 8B model) and
    // every workspace growth made all graphs stale, stalling every running stream mid-serving.
    int max_step = sp.enable_chunked_prefill ? sp.max_num_batched_tokens : PD_MAX(sp.max_num_batched_tokens, e->max_model_len);
    int n_graphs = 0;
    int64_t t_warm = pd_time_us();
    pd_status wst = pd_model_warmup(e->model, e->cache, max_step, p->role == PD_ROLE_PREFILL ? 0 : sp.max_num_seqs,
                                    e->max_model_len, &n_graphs);
    if (wst) {
        pd_err_set(err, wst, "warm-up for steps of %d tokens failed (%s): lower --max-num-batched-tokens or the KV cache size",
                   max_step, pd_status_str(wst));
        goto fail;
    }
    if (n_graphs > 0)
        PD_LOG_I("engine: captured %d decode graphs in %.1f s", n_graphs, (double)(pd_time_us() - t_warm) / 1e6);
    if (pd_engine_spec_warmup(e, err)) goto fail;
    if (pd_disagg_init(e, err)) goto fail;
    if (pd_tiers_init(e, pd_disagg_fingerprint(e), err)) goto fail;
    e->params.kv_offload_disk_dir = e->params.kv_remote_url = e->params.kv_offload_dtype = NULL;  // borrowed
    e->params.kv_secret = NULL;  // the connector copied it; this copy was borrowed for the call
    PD_LOG_I("engine: %s on %s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d", e->model_name,
             pd_backend_name(e->backend), n_blocks, e->params.block_size,
             (double)pd_buffer_size(pd_model_cache_buffer(e->cache)) / 1048576.0, e->max_model_len);
    return e;
fail:
    pd_engine_free(e);
    return NULL;
}

const pd_tok *pd_engine_tok(const pd_engine *e) { return e->tok; }
const pd_model_config *pd_engine_config(const pd_engine *e) { return pd_model_get_config(e->model); }
const char *pd_engine_model_name(const pd_engine *e) { return e->model_name; }
int pd_engine_event_fd(const pd_engine *e) { return e->q.efd; }
int pd_engine_poll(pd_engine *e, pd_engine_event *out, int max) { return pd_queue_poll_events(&e->q, out, max); }

void pd_engine_stats_get(pd_engine *e, pd_engine_stats *out) {
    pthread_mutex_lock(&e->q.mu);
    *out = e->q.stats;
    out->n_waiting += e->q.n_in_submits;
    pthread_mutex_unlock(&e->q.mu);
}

// ---- submit / abort (any thread) ---------------------------------------------------------------
pd_status pd_engine_submit(pd_engine *e, const pd_engine_request *r, pd_err *err) {
    const pd_model_config *c = pd_model_get_config(e->model);
    if (r->n_prompt <= 0) return pd_err_set(err, PD_ERR_INVALID, "the prompt is empty");
    if (r->max_tokens <= 0) return pd_err_set(err, PD_ERR_INVALID, "max_tokens must be at least 1");
    if ((int64_t)r->n_prompt + r->max_tokens > e->max_model_len)
        return pd_err_set(err, PD_ERR_INVALID,
                          "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                          "(%d in the prompt, %d in the completion). Please reduce the length of the prompt or max_tokens.",
                          e->max_model_len, (long long)r->n_prompt + r->max_tokens, r->n_prompt, r->max_tokens);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab_size)
            return pd_err_set(err, PD_ERR_INVALID, "token id %d at position %d is out of range [0, %d)", r->prompt[i], i, c->vocab_size);
    if (r->n_stop_ids < 0 || r->n_stop_ids > 16) return pd_err_set(err, PD_ERR_INVALID, "at most 16 stop token ids");
    pd_status st = pd_sampling_params_validate(&r->sampling, err);
    if (st) return st;
    pd_engine_stats s;
    pd_engine_stats_get(e, &s);
    if (s.n_waiting >= e->params.max_waiting) return pd_err_set(err, PD_NOSPACE, "the server is at capacity: %d requests waiting", s.n_waiting);
    pd_cmd *cmd = pd_calloc(1, sizeof *cmd);
    int32_t *prompt = pd_malloc(sizeof(int32_t) * (size_t)r->n_prompt);
    if (!cmd || !prompt) {
        pd_free(cmd);
        pd_free(prompt);
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    }
    memcpy(prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    cmd->kind = PD_CMD_SUBMIT;
    cmd->id = r->id;
    cmd->req = *r;
    cmd->prompt = prompt;
    cmd->req.prompt = prompt;
    if (r->n_stop_ids) memcpy(cmd->stop_ids, r->stop_ids, sizeof(int32_t) * (size_t)r->n_stop_ids);
    cmd->req.stop_ids = cmd->stop_ids;
    if (!cmd->req.arrival_us) cmd->req.arrival_us = pd_time_us();
    return pd_queue_push_cmd(&e->q, cmd);
}

void pd_engine_abort(pd_engine *e, uint64_t id) {
    pd_cmd *cmd = pd_calloc(1, sizeof *cmd);
    if (!cmd) return;  // the request then runs to completion; its events are dropped by id
    cmd->kind = PD_CMD_ABORT;
    cmd->id = id;
    pd_queue_push_cmd(&e->q, cmd);
}

// ---- engine thread -----------------------------------------------------------------------------
static void push_events_retry(pd_engine *e, const pd_engine_event *ev, int n);

void pd_engine_emit_finished(pd_engine *e, uint64_t id, pd_engine_finish f, int n_prompt, int n_cached, int n_out) {
    pd_engine_event ev = {.kind = PD_EV_FINISHED, .id = id, .finish = f, .n_prompt_tokens = n_prompt,
                          .n_cached_tokens = n_cached, .n_output_tokens = n_out};
    push_events_retry(e, &ev, 1);
}

static void handle_submit(pd_engine *e, pd_cmd *c) {
    const pd_engine_request *r = &c->req;
    pd_err err = {0};
    if (req_find(e, r->id)) {
        PD_LOG_W("engine: duplicate request id %llu rejected", (unsigned long long)r->id);
        pd_engine_emit_finished(e, r->id, PD_ENGINE_FINISH_ERROR, r->n_prompt, 0, 0);
        return;
    }
    ereq *q = pd_calloc(1, sizeof *q);
    if (q) q->sampler = pd_sampler_new(&r->sampling, pd_model_get_config(e->model)->vocab_size);
    bool has_ctl = r->ctl != NULL;
    if (q && q->sampler) {
        pd_status cs = pd_sampler_set_ctl(q->sampler, r->ctl);  // the sampler owns the ctl now
        c->req.ctl = NULL;
        if (cs) {
            pd_sampler_free(q->sampler);
            q->sampler = NULL;
        }
    }
    const pd_model_config *cfg = pd_model_get_config(e->model);
    pd_sched_req_params sp = {.req_id = r->id, .prompt = r->prompt, .n_prompt = r->n_prompt, .max_tokens = r->max_tokens,
                              .stop_ids = r->stop_ids, .n_stop_ids = r->n_stop_ids, .eos_ids = cfg->eos_token_ids,
                              .n_eos_ids = cfg->n_eos, .ignore_eos = r->ignore_eos, .priority = r->priority};
    // A constrained request (logit bias, token mask) samples its first token here: a prefill
    // worker would sample it without the constraint.
    int kv_worker = -1;
    sp.is_remote_prefill = e->params.role == PD_ROLE_DECODE && !has_ctl && pd_disagg_want_remote(e, r->prompt, r->n_prompt, &kv_worker);
    if (q) q->kv_worker = kv_worker;
    if (q && q->sampler && !sp.is_remote_prefill) sp.n_tier_tokens = pd_tiers_req_init(e, q, r->prompt, r->n_prompt);
    if (!q || !q->sampler || pd_engine_req_reserve(e) || pd_sched_add(e->sched, &sp, r->arrival_us, &err)) {
        if (q) pd_sampler_free(q->sampler);
        if (q) pd_tiers_req_fini(q);
        pd_free(q);
        PD_LOG_W("engine: request %llu rejected: %s", (unsigned long long)r->id, err.msg[0] ? err.msg : "out of memory");
        pd_engine_emit_finished(e, r->id, PD_ENGINE_FINISH_ERROR, r->n_prompt, 0, 0);
        return;
    }
    pd_sampler_add_prompt(q->sampler, r->prompt, r->n_prompt);
    // Not speculated when constrained: draft proposals and verification draw without the mask or
    // the logit bias (the request's rows are then sampled plainly, pd_sampler_sample).
    if (!has_ctl && pd_engine_spec_req_init(e, q, r)) {
        pd_sched_abort(e->sched, r->id);
        pd_engine_spec_req_fini(q);
        pd_sampler_free(q->sampler);
        pd_tiers_req_fini(q);
        pd_free(q);
        PD_LOG_W("engine: request %llu rejected: out of memory", (unsigned long long)r->id);
        pd_engine_emit_finished(e, r->id, PD_ENGINE_FINISH_ERROR, r->n_prompt, 0, 0);
        return;
    }
    if (sp.is_remote_prefill) {
        q->is_remote = true;
        q->prompt = c->prompt;  // the command's copy moves into the request
        c->prompt = NULL;
        q->sampling = r->sampling;
    }
    q->id = r->id;
    q->n_prompt = r->n_prompt;
    q->t_arrival_us = r->arrival_us;
    memcpy(q->traceparent, r->traceparent, sizeof q->traceparent);
    q->traceparent[sizeof q->traceparent - 1] = 0;
    pd_engine_req_insert(e, q);
    e->n_prompt_tokens += r->n_prompt;
}

static void handle_cmds(pd_engine *e, pd_cmd *c) {
    while (c) {
        pd_cmd *n = c->next;
        if (c->kind == PD_CMD_SUBMIT) {
            handle_submit(e, c);
        } else if (c->kind == PD_CMD_XFER && c->kev->kind == PD_KVCONN_EV_TIER_LOADED) {
            pd_tiers_handle(e, c->kev);
        } else if (c->kind == PD_CMD_XFER) {
            pd_disagg_handle(e, c->kev);
        } else if (req_find(e, c->id) && !req_find(e, c->id)->is_aborted) {
            ereq *r = req_find(e, c->id);
            int n_prompt = r->n_prompt;
            if (r->is_loading || r->is_export) {
                pd_disagg_abort(e, r);  // keeps the request until its transfer ends
            } else if (r->is_tier_loading) {
                pd_sched_abort(e->sched, c->id);  // its blocks stay until the load ends
                r->is_aborted = true;             // removed by pd_tiers_handle
            } else {
                pd_sched_abort(e->sched, c->id);
                req_remove(e, c->id);
            }
            pd_engine_emit_finished(e, c->id, PD_ENGINE_FINISH_ABORT, n_prompt, 0, 0);
        }
        pd_cmd_free(c);
        c = n;
    }
}

static pd_status reserve_bufs(pd_engine *e, const pd_step_plan *plan) {
    step_bufs *b = &e->sb;
    int V = pd_model_get_config(e->model)->vocab_size;
    int n_bt = 0;
    for (int i = 0; i < plan->n_seqs; i++) n_bt += plan->seqs[i].n_blocks;
    if (PD_ARRAY_RESERVE(b->tokens, b->cap_tokens, (size_t)plan->n_tokens) ||
        PD_ARRAY_RESERVE(b->bt_indices, b->cap_bt, (size_t)n_bt))
        return PD_ERR_NOMEM;
    size_t need = (size_t)plan->n_seqs + 1;
    if (need > b->cap_seqs) {
        // Every per-sequence array has cap_seqs entries; grow them together (each from the same
        // capacity to the same new one; on failure the arrays already grown keep it: harmless).
        void *arrs[] = {&b->q_indptr, &b->kv_lens, &b->bt_indptr, &b->logit_rows,
                        &b->logit_seq, &b->logits, &b->outputs, &b->results};
        size_t elem[] = {4, 4, 4, 4, 4, sizeof(float) * (size_t)V, sizeof(pd_step_output), sizeof(pd_sample_result)};
        size_t cap = 0;
        for (size_t i = 0; i < PD_ARRAY_LEN(arrs); i++) {
            cap = b->cap_seqs;
            if (pd_array_reserve(arrs[i], elem[i], &cap, need)) return PD_ERR_NOMEM;
        }
        b->cap_seqs = cap;
    }
    return PD_OK;
}

// ---- sampling ------------------------------------------------------------------------------------
// A backend with a sampling op (CUDA) samples on the device: the logits stay there and only the
// tokens (and requested logprobs) come back, one small copy per step. Otherwise the logits are
// downloaded and the rows sampled on all cores. The per-request pd_sampler owns the state either
// way (seed, draw counter, token counts); pd_sampler_accept records every token.
// PD_DEVICE_SAMPLING=0 in the environment forces the host path (A/B measurements).
static bool use_device_sampling(pd_engine *e) {
    step_bufs *b = &e->sb;
    if (!b->sample_mode) {
        const char *env = getenv("PD_DEVICE_SAMPLING");
        bool off = env && !strcmp(env, "0");
        b->sample_mode = pd_backend_has_sample(e->backend) && !off ? 1 : 2;
    }
    return b->sample_mode == 1;
}

// Grows the device-sampling host arrays (grow-only: a warm engine does not allocate).
static bool reserve_sample_bufs(step_bufs *b, int n_rows, int n_pens) {
    size_t cap = b->cap_srows;  // srows and souts share cap_srows
    if (PD_ARRAY_RESERVE(b->srows, cap, (size_t)n_rows)) return false;
    cap = b->cap_srows;
    if (PD_ARRAY_RESERVE(b->souts, cap, (size_t)n_rows)) return false;
    b->cap_srows = cap;
    return !PD_ARRAY_RESERVE(b->spens, b->cap_spens, (size_t)n_pens);
}

static pd_status sample_on_device(pd_engine *e, const pd_step_plan *plan, const pd_batch *batch) {
    step_bufs *b = &e->sb;
    int nl = batch->n_logits, V = pd_model_get_config(e->model)->vocab_size;
    const float *dl = NULL;
    int64_t t_fwd = pd_time_us();
    bool tm = pd_backend_has_timer(e->backend);
    if (tm) pd_backend_timer_mark(e->backend, 0);
    pd_status st = pd_model_forward_dev(e->model, e->cache, batch, &dl);
    e->prof_launch_us += pd_time_us() - t_fwd;  // the host's part: launching the forward's kernels
    if (st) return st;
    if (tm) {
        if (e->tm_end != 1 && e->tm_end != 2) e->tm_end = 1;
        pd_backend_timer_mark(e->backend, e->tm_end);
        e->tm_marked = true;
    }
    if (nl == 0) {
        pd_backend_sync(e->backend);  // as pd_model_forward: the step's KV is written on return
        return PD_OK;
    }
    int n_pens = 0;
    for (int k = 0; k < nl; k++) n_pens += pd_sampler_n_pens(req_find(e, plan->seqs[b->logit_seq[k]].req_id)->sampler);
    if (!reserve_sample_bufs(b, nl, n_pens)) return PD_ERR_NOMEM;
    int off = 0, n_masks = 0, words = (V + 31) / 32;
    for (int k = 0; k < nl; k++) n_masks += pd_sampler_has_mask(req_find(e, plan->seqs[b->logit_seq[k]].req_id)->sampler);
    if (PD_ARRAY_RESERVE(b->smasks, b->cap_smasks, (size_t)n_masks * (size_t)words))  // token masks (constrained decoding)
        return PD_ERR_NOMEM;
    n_masks = 0;
    for (int k = 0; k < nl; k++) {
        ereq *r = req_find(e, plan->seqs[b->logit_seq[k]].req_id);
        pd_sampler_export_row(r->sampler, off, &b->srows[k], b->spens + off);
        off += b->srows[k].n_pens;
        if (pd_sampler_has_mask(r->sampler)) {
            pd_sampler_fill_mask(r->sampler, b->smasks + (size_t)n_masks * (size_t)words);
            b->srows[k].mask_row = n_masks++;
        }
    }
    // The logits are the model's workspace (writable, valid until the next forward); the op
    // applies penalties in place and restores them before it returns.
    pd_sample_params sp = {.logits = (float *)dl, .n_rows = nl, .vocab = V, .rows = b->srows, .pens = b->spens,
                           .n_pens = off, .out = b->souts, .masks = b->smasks, .n_masks = n_masks,
                           .mask_words = words};
    pd_op_sample(e->backend, &sp);
    for (int k = 0; k < nl; k++) {
        int i = b->logit_seq[k];
        ereq *r = req_find(e, plan->seqs[i].req_id);
        b->outputs[i].token = pd_sampler_import_result(r->sampler, &b->souts[k], &b->results[i]);
        pd_sampler_accept(r->sampler, b->outputs[i].token);
    }
    return PD_OK;
}

static pd_status sample_on_host(pd_engine *e, const pd_step_plan *plan, const pd_batch *batch) {
    step_bufs *b = &e->sb;
    int nl = batch->n_logits, V = pd_model_get_config(e->model)->vocab_size;
    pd_status st = pd_model_forward(e->model, e->cache, batch, b->logits);
    if (st) return st;
    // Rows are independent (one sampler per request): sample them in parallel. At a 128k
    // vocabulary one row costs ~1 ms of CPU, so a serial loop capped a GPU server at ~900 tok/s.
    // One thread per row at most: a team wider than the work only spins, and two servers on one
    // host (two replicas) would each spin a full-width team and contend for the cores.
    int n_threads = nl >= 4 && V >= 16384 ? PD_MIN(nl, omp_get_max_threads()) : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int k = 0; k < nl; k++) {
        int i = b->logit_seq[k];
        ereq *r = req_find(e, plan->seqs[i].req_id);
        PD_ASSERT(r);
        b->outputs[i].token = pd_sampler_sample(r->sampler, b->logits + (size_t)k * (size_t)V, &b->results[i]);
        pd_sampler_accept(r->sampler, b->outputs[i].token);
    }
    return PD_OK;
}

// Runs the forward for a plan and samples. Returns PD_OK or an error (the step's requests are then
// finished with ERROR by the caller).
static pd_status run_plan(pd_engine *e, const pd_step_plan *plan, bool *was_spec) {
    step_bufs *b = &e->sb;
    // Test hook: every Nth step fails as if out of memory (its requests fail, the server goes on).
    if (e->params.debug_fail_step_every > 0 && ++e->n_debug_steps % e->params.debug_fail_step_every == 0)
        return PD_ERR_NOMEM;
    int64_t t_start = pd_time_us();
    pd_status st = reserve_bufs(e, plan);
    if (st) return st;
    // Speculative decoding (engine/spec.c) runs steps with drafts itself; the rest run below.
    *was_spec = false;
    if (e->spec) pd_tiers_step_begin(e, NULL);  // its forwards take no layer hook: tier copies fenced
    st = pd_engine_spec_run_plan(e, plan, was_spec);
    if (st) return st;
    if (*was_spec) goto account;
    int t = 0, nl = 0, bt = 0;
    b->q_indptr[0] = b->bt_indptr[0] = 0;
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        memcpy(b->tokens + t, s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
        t += s->n_tokens;
        b->q_indptr[i + 1] = t;
        b->kv_lens[i] = s->pos_start + s->n_tokens;
        memcpy(b->bt_indices + bt, s->block_ids, sizeof(int32_t) * (size_t)s->n_blocks);
        bt += s->n_blocks;
        b->bt_indptr[i + 1] = bt;
        if (s->needs_logits) {
            b->logit_rows[nl] = t - 1;
            b->logit_seq[nl++] = i;
        }
        b->outputs[i] = (pd_step_output){.token = -1};
    }
    pd_batch batch = {.n_tokens = t, .tokens = b->tokens, .n_seqs = plan->n_seqs, .q_indptr = b->q_indptr,
                      .kv_lens = b->kv_lens, .bt_indptr = b->bt_indptr, .bt_indices = b->bt_indices, .n_logits = nl,
                      .logit_rows = b->logit_rows};
    pd_disagg_step_begin(e, plan, &batch);  // prefill role: layer-wise KV saves ride on the forward pass
    pd_tiers_step_begin(e, &batch);  // same-step tier loads: layer l's copy before layer l's compute
    st = use_device_sampling(e) ? sample_on_device(e, plan, &batch) : sample_on_host(e, plan, &batch);
    if (st) return st;
account:
    // Prefill work actually done: prompt positions computed in this step (a prefix hit or a
    // remote prefill computes fewer; a recompute after preemption computes them again).
    int64_t t_end = pd_time_us();
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        ereq *r = req_find(e, s->req_id);
        int end = PD_MIN(s->pos_start + s->n_tokens, r ? r->n_prompt : 0);
        if (end > s->pos_start) e->n_prefill_computed += end - s->pos_start;
        if (r && !r->t_sched_us) r->t_sched_us = t_start;  // TTFT breakdown
        if (r && !r->t_kv_ready_us && s->pos_start + s->n_tokens >= r->n_prompt) r->t_kv_ready_us = t_end;
    }
    return PD_OK;
}

static pd_engine_finish map_finish(pd_finish_reason f) {
    switch (f) {
    case PD_FINISH_STOP: return PD_ENGINE_FINISH_STOP;
    case PD_FINISH_LENGTH: return PD_ENGINE_FINISH_LENGTH;
    case PD_FINISH_ABORT: return PD_ENGINE_FINISH_ABORT;
    default: return PD_ENGINE_FINISH_ERROR;
    }
}

// The queue grows its array to take events; when that allocation fails, retry a few times (the
// consumer frees memory as it drains), then push one at a time so that at least what fits goes.
static void push_events_retry(pd_engine *e, const pd_engine_event *ev, int n) {
    for (int tries = 0; n > 0 && pd_queue_push_events(&e->q, ev, n) != PD_OK; tries++) {
        if (tries >= 50) {
            for (int i = 0; i < n; i++)
                while (pd_queue_push_events(&e->q, &ev[i], 1) != PD_OK) poll(NULL, 0, 10);
            return;
        }
        poll(NULL, 0, 10);
    }
}

// Turns scheduler events into engine events (TOKEN, then FINISHED when the request ended).
void pd_engine_push_sched_events(pd_engine *e, const pd_step_plan *plan, const pd_sample_result *results,
                                 const pd_sched_event *ev, int n) {
    step_bufs *b = &e->sb;
    (void)PD_ARRAY_RESERVE(b->events, b->cap_events, 2 * (size_t)n);  // on failure: the spill below
    // Without room for all (out of memory), events go out in chunks through a small fixed buffer:
    // none is ever dropped (a lost FINISHED would leave its client hanging).
    pd_engine_event spill[16];
    bool roomy = 2 * (size_t)n <= b->cap_events;
    pd_engine_event *out = roomy ? b->events : spill;
    int cap = roomy ? (int)PD_MIN(b->cap_events, (size_t)INT_MAX) : (int)PD_ARRAY_LEN(spill);
    int k = 0;
    for (int j = 0; j < n; j++) {
        if (k + 2 > cap) {
            push_events_retry(e, out, k);
            k = 0;
        }
        const pd_sched_event *s = &ev[j];
        ereq *q = req_find(e, s->req_id);
        if (q && q->is_export) {
            // Prefill role: the first token and the KV go back to the decode worker, not to an
            // API client.
            if (s->finish != PD_FINISH_NONE) {
                pd_sample_result first = {.token = s->token};
                for (int i = 0; plan && i < plan->n_seqs; i++)
                    if (plan->seqs[i].req_id == s->req_id && plan->seqs[i].needs_logits) first = results[i];
                first.token = s->token;
                pd_disagg_export(e, q, s, &first);
            }
            continue;
        }
        if (s->token >= 0) {
            pd_engine_event *o = &out[k++];
            memset(o, 0, sizeof *o);
            o->kind = PD_EV_TOKEN;
            o->id = s->req_id;
            o->n_prompt_tokens = s->n_prompt_tokens;
            o->n_cached_tokens = s->n_cached_tokens;
            o->n_output_tokens = s->n_output_tokens;
            const pd_sample_result *spec_res = plan ? pd_engine_spec_result(e, s->seq_index, s->out_index) : NULL;
            if (spec_res) o->tok = *spec_res;  // a speculative step: one result per token
            else
                for (int i = 0; plan && i < plan->n_seqs; i++)
                    if (plan->seqs[i].req_id == s->req_id && plan->seqs[i].needs_logits) {
                        o->tok = results[i];
                        break;
                    }
            o->tok.token = s->token;
            if (q && !q->is_first_sent) {  // TTFT breakdown rides on the first token
                q->is_first_sent = true;
                o->is_remote_prefill = q->is_kv_remote;
                o->t_arrival_us = q->t_arrival_us;
                o->t_sched_us = q->t_sched_us;
                o->t_kv_ready_us = q->t_kv_ready_us;
                o->remote_queue_us = q->remote_queue_us;
                o->remote_compute_us = q->remote_compute_us;
            }
            if (q) pd_engine_spec_push_token(q, s->token);
            e->n_generated++;
        }
        if (s->finish != PD_FINISH_NONE) {
            pd_engine_event *o = &out[k++];
            memset(o, 0, sizeof *o);
            o->kind = PD_EV_FINISHED;
            o->id = s->req_id;
            o->finish = map_finish(s->finish);
            o->n_prompt_tokens = s->n_prompt_tokens;
            o->n_cached_tokens = s->n_cached_tokens;
            o->n_output_tokens = s->n_output_tokens;
            pd_engine_spec_fill_finished(e, q, o);
            req_remove(e, s->req_id);
            e->n_finished++;
        }
    }
    push_events_retry(e, out, k);
}

static void publish_stats(pd_engine *e) {
    pd_sched_stats ss;
    pd_kv_stats ks;
    pd_sched_stats_get(e->sched, &ss);
    pd_kv_stats_get(e->kv, &ks);
    pd_tiers_drain_kv_events(e);
    pd_engine_stats tst = {0};
    pd_tiers_stats(e, &tst);  // (tier locks: outside q.mu)
    pthread_mutex_lock(&e->q.mu);
    pd_engine_stats *o = &e->q.stats;
    o->n_running = ss.n_running;
    o->n_waiting = ss.n_waiting;
    o->n_blocks_total = ks.n_blocks;
    o->n_blocks_free = ks.n_free;
    o->n_blocks_used = ks.n_used;
    o->n_blocks_cached = ks.n_cached;
    o->n_prompt_tokens = e->n_prompt_tokens;
    o->n_generation_tokens = e->n_generated;
    o->n_prefix_query_tokens = ks.n_query_tokens;
    o->n_prefix_hit_tokens = ks.n_hit_tokens;
    o->n_prefill_tokens_computed = e->n_prefill_computed;
    o->n_preemptions = ss.n_preemptions;
    o->n_steps = ss.n_steps;
    o->n_requests_finished = e->n_finished;
    o->n_kv_handoffs = e->n_handoffs;
    memcpy(o->n_kv_fallbacks, e->n_fallbacks, sizeof o->n_kv_fallbacks);
    o->n_kv_local_short = e->n_local_short;
    o->n_disagg_decide_local = e->n_decide_local;
    o->n_disagg_decide_remote = e->n_decide_remote;
    o->n_kv_handoff_bytes = e->handoff_bytes;
    o->kv_handoff_us_total = e->handoff_us;
    o->n_kv_exports = e->n_exports;
    o->n_kv_export_bytes = e->export_bytes;
    o->kv_export_copy_us_total = e->export_copy_us;
    if (e->kc) {
        pd_kvconn_stats ks2;
        pd_kvconn_stats_get(e->kc, &ks2);
        o->n_kv_auth_failures = ks2.auth_failures;
        o->n_kv_proto_errors = ks2.proto_errors;
        o->n_kv_conns_accepted = ks2.conns_accepted;
        o->n_kv_slow_peer_drops = ks2.slow_peer_drops;
        o->n_kv_fenced = ks2.fenced;
        o->n_kv_peers_refused = ks2.peers_refused;
        o->n_kv_saves_layerwise = ks2.saves_layerwise;
        o->n_kv_saves_failed = ks2.saves_failed;
    }
    pd_engine_spec_stats(e, o);
    o->n_tiers = tst.n_tiers;
    memcpy(o->tiers, tst.tiers, sizeof o->tiers);
    memcpy(o->tier_dtype, tst.tier_dtype, sizeof o->tier_dtype);
    o->tier_offloads = tst.tier_offloads, o->tier_offloads_dropped = tst.tier_offloads_dropped;
    o->tier_loads = tst.tier_loads, o->tier_load_blocks = tst.tier_load_blocks, o->tier_promotions = tst.tier_promotions;
    o->n_tier_hit_tokens = tst.n_tier_hit_tokens, o->n_tier_loads_done = tst.n_tier_loads_done;
    o->tier_load_us_total = tst.tier_load_us_total;
    memcpy(o->tier_remote_notify, tst.tier_remote_notify, sizeof o->tier_remote_notify);
    pthread_mutex_unlock(&e->q.mu);
}

// Recent prefill throughput and decode step time (EMA), for routers' admission predictions.
static void measure_step(pd_engine *e, const pd_step_plan *plan, int64_t us) {
    int n_prefill = 0;
    for (int i = 0; i < plan->n_seqs; i++)
        if (plan->seqs[i].n_tokens > 1 || !plan->seqs[i].needs_logits) n_prefill += plan->seqs[i].n_tokens;
    double a = 0.2;
    int n_tok = 0;
    for (int i = 0; i < plan->n_seqs; i++) n_tok += plan->seqs[i].n_tokens;
    pthread_mutex_lock(&e->q.mu);
    // The step-time model (wire/link.h): steps that carry prefill work, over all their tokens
    // (decode rows included). Decode-only steps stay out: their cost is attention over context,
    // not tokens, and they would swamp the fit the local/remote prefill decision needs.
    if (n_prefill > 0 && us > 0) pd_link_fit_add(&e->step_fit, (double)n_tok, (double)us, 0.1);
    e->n_running_now = plan->n_seqs;
    double fa, fb;
    if (e->kc && e->params.role == PD_ROLE_PREFILL && pd_link_fit_get(&e->step_fit, &fa, &fb))  // for decode workers' link models
        pd_kvconn_set_step_model(e->kc, fa, fb, e->params.enable_chunked_prefill ? e->params.max_num_batched_tokens : 0);
    if (n_prefill > 0 && us > 0) {
        double tps = (double)n_prefill * 1e6 / (double)us;
        e->ema_prefill_tps = e->ema_prefill_tps < 0 ? tps : (1 - a) * e->ema_prefill_tps + a * tps;
    } else if (plan->n_seqs > 0) {
        double ms = (double)us / 1000.0;
        e->ema_decode_ms = e->ema_decode_ms < 0 ? ms : (1 - a) * e->ema_decode_ms + a * ms;
    }
    pthread_mutex_unlock(&e->q.mu);
}

static void engine_step(pd_engine *e) {
    pd_step_plan plan;
    int64_t t0 = pd_time_us();
    pd_tiers_drain_kv_events(e);  // blocks cached by commands, before schedule may reuse them
    pd_sched_schedule(e->sched, t0, &plan);
    if (plan.n_finished) pd_engine_push_sched_events(e, NULL, NULL, plan.finished, plan.n_finished);
    if (plan.n_kv_loads) pd_disagg_start_loads(e, &plan);
    if (plan.n_tier_loads) pd_tiers_start_loads(e, &plan);
    e->last_step_empty = plan.n_seqs == 0 && plan.n_kv_loads == 0 && plan.n_tier_loads == 0;
    if (plan.n_seqs == 0) {
        pd_tiers_step_end(e);
        return;
    }
    bool was_spec = false;
    int64_t t_run = pd_time_us();
    pd_status st = run_plan(e, &plan, &was_spec);
    pd_tiers_step_end(e);  // (a failed or hookless step: the tier copies get a fence)
    int64_t t_ran = pd_time_us();
    e->n_saves = 0;  // the layer hook ran during the forward pass only
    pd_step_output *outs = e->sb.outputs;
    if (st) {
        // A failed step (device error, OOM) fails the requests in it, not the server.
        PD_LOG_E("engine: step failed: %s", pd_status_str(st));
        for (int i = 0; i < plan.n_seqs; i++) {
            uint64_t id = plan.seqs[i].req_id;
            ereq *r = req_find(e, id);
            if (r && r->is_export) {  // no client here: the decode worker is told at once
                pd_disagg_step_failed(e, id);
                continue;
            }
            int np = r ? r->n_prompt : 0;
            pd_sched_abort(e->sched, id);
            req_remove(e, id);
            pd_engine_emit_finished(e, id, PD_ENGINE_FINISH_ERROR, np, 0, 0);
        }
        const pd_sched_event *ev;
        int32_t n;
        pd_sched_update(e->sched, &plan, NULL, pd_time_us(), &ev, &n);
        return;
    }
    const pd_sched_event *ev = NULL;
    int32_t n_ev = 0;
    st = pd_sched_update(e->sched, &plan, outs, pd_time_us(), &ev, &n_ev);
    PD_ASSERT(st == PD_OK);
    pd_tiers_drain_kv_events(e);  // the step's new full blocks go to the tiers (write-back)
    measure_step(e, &plan, pd_time_us() - t0);
    pd_engine_spec_after_update(e, &plan, pd_time_us() - t0, was_spec);
    pd_engine_push_sched_events(e, &plan, e->sb.results, ev, n_ev);
    int64_t t_end = pd_time_us();
    if (e->tm_marked) {  // (the sampling synchronised: both marks were reached)
        float f = pd_backend_timer_ms(e->backend, 0, e->tm_end);
        if (f >= 0) e->prof_gpu_fwd_ms += f, e->prof_gpu_n++;
        // Between the previous forward's end and this one's start, when the engine did not idle
        // in between (a previous step less than 20 ms before this one began).
        float g = e->tm_have_prev && t0 - e->prof_last_end_us < 20000 ? pd_backend_timer_ms(e->backend, 3 - e->tm_end, 0) : -1;
        if (g >= 0) e->prof_gpu_between_ms += g, e->prof_gpu_between_n++;
        e->tm_have_prev = true;
        e->tm_end = 3 - e->tm_end;
        e->tm_marked = false;
    } else {
        e->tm_have_prev = false;
    }
    if (e->prof_last_end_us) e->prof_gap_us += t0 - e->prof_last_end_us;
    e->prof_last_end_us = t_end;
    e->prof_steps++;
    e->prof_seqs += plan.n_seqs;
    e->prof_tokens += plan.n_tokens;
    e->prof_pre_us += t_run - t0;
    e->prof_run_us += t_ran - t_run;
    e->prof_post_us += t_end - t_ran;
}

static void *engine_main(void *arg) {
    pd_engine *e = arg;
    if (e->params.n_threads > 0) omp_set_num_threads(e->params.n_threads);  // per-thread setting
    for (;;) {
        // No work: sleep until a command (with KV tiers, at most 100 ms: the tiers' own events, such
        // as Redis evicting pages by itself, reach routers while idle too). Work that cannot
        // progress (KV loads in flight, nothing schedulable): sleep briefly, or until a command.
        int64_t wait_us = !pd_sched_has_work(e->sched) ? (e->tiers ? 100000 : -1) : e->last_step_empty ? 2000 : 0;
        bool stopping;
        pd_cmd *c = pd_queue_pop_cmds(&e->q, wait_us, &stopping);
        if (stopping) {
            handle_cmds(e, c);
            break;
        }
        handle_cmds(e, c);
        if (pd_sched_has_work(e->sched)) engine_step(e);
        publish_stats(e);
    }
    return NULL;
}

pd_status pd_engine_start(pd_engine *e) {
    publish_stats(e);
    if (pthread_create(&e->thread, NULL, engine_main, e)) return PD_ERR_IO;
    e->started = true;
    return PD_OK;
}

void pd_engine_free(pd_engine *e) {
    if (!e) return;
    if (e->started) {
        pd_queue_stop(&e->q);
        pthread_join(e->thread, NULL);
    }
    if (e->prof_steps > 0) {
        double n = (double)e->prof_steps;
        pd_sched_stats ss = {0};
        if (e->sched) pd_sched_stats_get(e->sched, &ss);
        PD_LOG_I("engine: %lld steps ran, %.2f seqs and %.1f tokens a step; engine thread a step: run (forward + "
                 "sampling) %.2f ms of which launching the forward %.2f ms, schedule + load start %.3f ms, update + offload + events %.3f ms, gap before "
                 "the next step %.3f ms; backfill passes %lld, tier loads without room to compute in their step %lld",
                 (long long)e->prof_steps, (double)e->prof_seqs / n, (double)e->prof_tokens / n, e->prof_run_us / n / 1e3,
                 e->prof_launch_us / n / 1e3, e->prof_pre_us / n / 1e3, e->prof_post_us / n / 1e3, e->prof_gap_us / n / 1e3,
                 (long long)ss.n_backfill_passes, (long long)ss.n_join_short);
        if (e->prof_gpu_n > 0)
            PD_LOG_I("engine: device time a step: forward %.2f ms (%lld steps); previous forward's end -> this one's "
                     "start %.2f ms (%lld steps back to back)",
                     e->prof_gpu_fwd_ms / (double)e->prof_gpu_n, (long long)e->prof_gpu_n,
                     e->prof_gpu_between_n ? e->prof_gpu_between_ms / (double)e->prof_gpu_between_n : 0.0,
                     (long long)e->prof_gpu_between_n);
    }
    pd_disagg_fini(e);  // joins the xfer threads, which push into the queue
    pd_tiers_fini(e);   // runs queued tier work (loads write into the cache), joins
    for (size_t i = 0; i < e->reqs.cap; i++)
        for (ereq *q; (q = pd_engine_req_at(e, i));) {  // a delete may shift another entry into slot i
            uint64_t id = q->id;
            if (e->sched) pd_sched_abort(e->sched, id);
            req_remove(e, id);
        }
    pd_map_fini(&e->reqs);
    pd_sched_free(e->sched);
    pd_engine_spec_fini(e);
    pd_kv_mgr_free(e->kv);
    pd_wire_kv_log_free(e->kv_log);
    pd_model_cache_free(e->cache);
    pd_model_free(e->model);
    pd_tok_free(e->tok);
    pd_backend_free(e->backend);
    step_bufs *b = &e->sb;
    pd_free(b->tokens), pd_free(b->q_indptr), pd_free(b->kv_lens), pd_free(b->bt_indptr), pd_free(b->bt_indices);
    pd_free(b->logit_rows), pd_free(b->logit_seq), pd_free(b->logits), pd_free(b->outputs), pd_free(b->results);
    pd_free(b->srows), pd_free(b->souts), pd_free(b->spens), pd_free(b->smasks);
    pd_free(b->events);
    pd_free(e->layer_k);
    pd_free(e->layer_v);
    pd_queue_fini(&e->q);
    pd_free(e);
}

pd_status pd_engine_state(pd_engine *e, uint64_t since, int max_events, pd_wire_state *out) {
    memset(out, 0, sizeof *out);
    out->instance = e->instance;
    snprintf(out->model, sizeof out->model, "%.127s", e->model_name);
    out->role = e->params.role == PD_ROLE_PREFILL ? PD_WIRE_ROLE_PREFILL : e->params.role == PD_ROLE_DECODE ? PD_WIRE_ROLE_DECODE
                                                                                                          : PD_WIRE_ROLE_BOTH;
    out->block_size = e->params.block_size;
    pthread_mutex_lock(&e->q.mu);
    const pd_engine_stats *s = &e->q.stats;
    pd_wire_load *l = &out->load;
    *l = pd_wire_load_default();
    l->n_running = s->n_running;
    l->n_waiting = s->n_waiting + e->q.n_in_submits;
    l->n_kv_blocks_total = s->n_blocks_total;
    l->n_kv_blocks_free = s->n_blocks_free;
    l->n_kv_blocks_used = s->n_blocks_used;
    l->n_kv_blocks_cached = s->n_blocks_cached;
    l->prefill_tokens_per_s = e->ema_prefill_tps;
    l->decode_step_ms = e->ema_decode_ms;
    l->n_prefix_query_tokens = s->n_prefix_query_tokens;
    l->n_prefix_hit_tokens = s->n_prefix_hit_tokens;
    l->n_requests_finished = s->n_requests_finished;
    l->n_max_seqs = e->max_num_seqs;
    l->n_max_waiting = e->params.max_waiting;
    l->n_kv_handoffs = s->n_kv_handoffs;
    l->n_kv_handoff_bytes = s->n_kv_handoff_bytes;
    l->kv_handoff_us = s->kv_handoff_us_total;
    for (int i = 0; i < PD_FALLBACK_N && i < PD_WIRE_N_FALLBACKS; i++) l->n_kv_fallbacks[i] = s->n_kv_fallbacks[i];
    l->n_kv_local_short = s->n_kv_local_short;
    l->n_kv_exports = s->n_kv_exports;
    l->n_kv_export_bytes = s->n_kv_export_bytes;
    l->n_tiers = PD_MIN(s->n_tiers, PD_WIRE_MAX_TIERS);
    for (int i = 0; i < l->n_tiers; i++) {
        snprintf(l->tier_names[i], sizeof l->tier_names[i], "%s", s->tiers[i].name);
        l->tier_hits[i] = s->tiers[i].hits;
        l->tier_misses[i] = s->tiers[i].misses;
    }
    l->n_tier_hit_tokens = s->n_tier_hit_tokens;
    l->tier_load_us = s->tier_load_us_total;
    pd_status st = pd_wire_kv_log_read(e->kv_log, since, max_events, out);
    pthread_mutex_unlock(&e->q.mu);
    return st;
}

int pd_engine_max_model_len(const pd_engine *e) { return e->max_model_len; }
