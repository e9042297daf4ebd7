// disagg.c — the engine's half of disaggregated prefill/decode. It talks to the KV connector
// (kvconn/kvconn.h) only: no transport, no socket, no wire frame is handled here.
//
// Decode role (owns the request):
//   submit ─► want_remote? (pd_kvconn_match_tokens: uncached prompt tokens >= disagg_min_tokens
//   and a healthy prefill worker) ─► pd_sched_add(is_remote_prefill) ─► the scheduler reserves
//   blocks for the whole prompt and lists a kv_load ─► pd_kvconn_start_load (prompt, first
//   uncached position, the reserved blocks) ─► ... ─► LOAD_DONE: pd_kvconn_load_verify (per-layer
//   checksums over our own blocks) ─► pd_sched_kv_loaded(ok, first token) and decode, continuing
//   the remote sampler's draw counter; any failure (worker unavailable, died, timed out, refused,
//   checksum mismatch) ─► pd_sched_kv_loaded(!ok): the prompt is prefilled locally from its
//   prefix-cache hit, counted as a fallback with its reason. KV that failed verification is never
//   decoded from; blocks of a load are reused only after its LOAD_DONE (the writer acknowledged,
//   or was fenced off — the connector decides).
//
// Prefill role (serves decode workers):
//   PEER_UP ─► pd_kvconn_peer_up (maps and checks the decode pool) ─► SAVE_REQUEST ─►
//   pd_kvconn_check_request ─► an internal request (max_tokens 1, is_hold_blocks) ─► the engine
//   prefills it like any other (own prefix cache, chunking, batching) ─► the step holding its last
//   prompt chunk starts a save (pd_kvconn_save_begin) and the model's layer hook ships each layer
//   as soon as it is computed (tcp: queued, sent by the connection's writer while the next layer
//   computes) ─► after sampling, pd_kvconn_save_end sends what is left and PREFILL_DONE with the
//   first token and the sampler's draw count ─► release the blocks. A step that fails sends
//   PREFILL_FAIL for its saves at once.
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "base/buf.h"
#include "engine/engine_impl.h"
#include "metrics/trace.h"

const char *pd_fallback_reason_name(pd_fallback_reason r) {
    static const char *n[] = {"unavailable", "timeout", "worker_died", "checksum", "error", "pool_refused"};
    return r < PD_FALLBACK_N ? n[r] : "unknown";
}

int pd_engine_kv_port(const pd_engine *e) { return e->kc ? pd_kvconn_port(e->kc) : 0; }
int pd_engine_n_prefill_healthy(pd_engine *e) { return e->kc ? pd_kvconn_n_healthy(e->kc) : 0; }
pd_kvw_transport pd_engine_kv_transport(const pd_engine *e) { return e->params.kv_transport; }

pd_kvw_fingerprint pd_disagg_fingerprint(pd_engine *e) {
    const pd_model_config *c = pd_model_get_config(e->model);
    pd_kvw_fingerprint f = {.arch = (uint32_t)c->arch, .n_layers = (uint32_t)c->n_layers, .n_heads = (uint32_t)c->n_heads,
                            .n_kv_heads = (uint32_t)c->n_kv_heads, .head_dim = (uint32_t)c->head_dim,
                            .hidden = (uint32_t)c->hidden_size, .vocab = (uint32_t)c->vocab_size,
                            .kv_dtype = (uint32_t)(pd_model_kv_dtype(e->model) == PD_KV_FP8 ? PD_DTYPE_FP8_E4M3 : pd_backend_act_dtype(e->backend)), .block_size = (uint32_t)e->params.block_size};
    // The weights' metadata: every shape-determining field, the RoPE setup and the total weight
    // bytes; dummy weights also hash their seed origin, so dummy and real never mix.
    // Hashed as explicit doubles (no struct padding in the hash input).
    double meta[] = {c->rope_theta, c->rope_factor, c->rms_norm_eps, c->intermediate_size, c->max_position_embeddings,
                     (double)c->rope_type, c->tie_word_embeddings, c->attention_bias, e->params.dummy_weights,
                     e->params.dummy_scale_from, e->params.dummy_scale_eps,
                     (double)(pd_model_weight_bytes(e->model) / pd_dtype_size(pd_backend_weight_dtype(e->backend)))};
    f.weights_hash = XXH3_64bits(&meta, sizeof meta);
    return f;
}

// Called on connector threads: move the event into the engine's command queue.
static void on_kv_event(void *ud, pd_kvconn_event *ev) {
    pd_engine *e = ud;
    pd_cmd *c = pd_calloc(1, sizeof *c);
    if (!c) {
        // Not dropped silently for a load: its blocks stay reserved and the request would hang,
        // so the event is kept by retrying the allocation (bounded: OOM at this size is fatal).
        for (int i = 0; i < 100 && !c; i++) {
            poll(NULL, 0, 10);
            c = pd_calloc(1, sizeof *c);
        }
        PD_ASSERT(c);
    }
    c->kind = PD_CMD_XFER;
    c->kev = ev;
    pd_queue_push_cmd(&e->q, c);
}

pd_status pd_disagg_init(pd_engine *e, pd_err *err) {
    const pd_engine_params *p = &e->params;
    const pd_model_config *c = pd_model_get_config(e->model);
    e->next_internal_id = 1ull << 62;
    bool decode = p->role == PD_ROLE_DECODE && p->n_prefill_addrs > 0;
    if (!decode && p->role != PD_ROLE_PREFILL) return PD_OK;
    pd_kvconn_params kp = {.role = decode ? PD_KVCONN_DECODE : PD_KVCONN_PREFILL, .transport = p->kv_transport,
                           .host = p->kv_host, .port = p->kv_port, .secret = p->kv_secret, .fp = pd_disagg_fingerprint(e),
                           .backend = e->backend, .timeout_ms = p->disagg_timeout_ms,
                           .corrupt_every = p->debug_corrupt_every, .debug_pause = p->debug_kv_pause,
                           .debug_refuse_pools = p->debug_refuse_kv_pools,
                           .on_event = on_kv_event, .ud = e, .on_enqueue = p->on_prefill_enqueue,
                           .enqueue_ud = p->prefill_enqueue_ud};
    if (!p->kv_secret)
        return pd_err_set(err, PD_ERR_INVALID, "the %s role needs --auth-token-file (the KV connections authenticate)",
                          decode ? "decode" : "prefill");
    kp.n_workers = decode ? PD_MIN(p->n_prefill_addrs, PD_KVCONN_MAX_WORKERS) : 0;
    for (int i = 0; i < kp.n_workers; i++) kp.addrs[i] = p->prefill_addrs[i];
    kp.cache = (pd_kvconn_cache){.n_layers = c->n_layers, .n_blocks = pd_model_cache_n_blocks(e->cache),
                                 .block_size = p->block_size,
                                 .row_bytes = pd_model_kv_row_bytes(e->model),
                                 .k = e->layer_k, .v = e->layer_v, .buffer = pd_model_cache_buffer(e->cache)};
    e->kc = pd_kvconn_new(&kp, err);
    if (!e->kc) return err ? err->status : PD_ERR_IO;
    if (decode)
        PD_LOG_I("engine: decode role, %d prefill worker(s), KV transport %s, disagg-min-tokens %d", p->n_prefill_addrs,
                 pd_kvconn_transport_name(e->kc), p->disagg_min_tokens);
    else
        PD_LOG_I("engine: prefill role, KV port %d", pd_kvconn_port(e->kc));
    return PD_OK;
}

void pd_disagg_fini(pd_engine *e) {
    pd_kvconn_free(e->kc);
    e->kc = NULL;
    pd_free(e->saves);
    e->saves = NULL;
    e->n_saves = e->cap_saves = 0;
}

void pd_disagg_req_fini(ereq *q) {
    pd_free(q->prompt);
    pd_free(q->load_blocks);
    pd_free(q->dst_blocks);
    q->prompt = q->load_blocks = q->dst_blocks = NULL;
}

// The link-aware model (wire/link.h) as this decode worker sees it now. Any thread.
void pd_engine_disagg_model(pd_engine *e, pd_disagg_model *m) {
    memset(m, 0, sizeof *m);
    m->local_a_us = m->local_b_us = -1;
    pthread_mutex_lock(&e->q.mu);
    double a, b;
    if (pd_link_fit_get(&e->step_fit, &a, &b)) m->local_a_us = a, m->local_b_us = b;
    int64_t running = e->n_running_now;
    pthread_mutex_unlock(&e->q.mu);
    m->chunk_tokens = e->params.enable_chunked_prefill ? e->params.max_num_batched_tokens : 0;
    m->local_queue_tokens = running;  // each local step also carries the running decode rows
    m->min_tokens = e->params.disagg_min_tokens;
    if (e->kc && e->params.role == PD_ROLE_DECODE) {
        m->bytes_per_token = pd_kvconn_bytes_per_token(e->kc);
        m->n_links = pd_kvconn_links(e->kc, m->links, PD_LINK_MAX);
    }
}

pd_status pd_engine_prefill_claim(pd_engine *e, uint64_t req_id, const char *worker_addr) {
    return e->kc ? pd_kvconn_claim(e->kc, req_id, worker_addr) : PD_ERR_NOTFOUND;
}

bool pd_disagg_want_remote(pd_engine *e, const int32_t *prompt, int n_prompt, int *worker) {
    *worker = e->params.on_prefill_enqueue ? PD_KVCONN_QUEUE : -1;
    if (!e->kc || e->params.role != PD_ROLE_DECODE) return false;
    pd_kv_seq tmp;
    pd_kv_seq_init(&tmp, 0);
    int32_t hit = pd_kv_peek_computed(e->kv, &tmp, prompt, n_prompt);
    pd_kv_seq_fini(&tmp);
    pd_kvconn_match m;
    pd_kvconn_match_tokens(e->kc, n_prompt, hit < 0 ? 0 : hit, &m);
    int n_uncached = n_prompt - (hit < 0 ? 0 : hit);
    if (n_uncached < e->params.disagg_min_tokens) {
        e->n_local_short++;
        return false;
    }
    if (m.worker < 0 || m.n_tokens <= 0) {
        e->n_fallbacks[PD_FALLBACK_UNAVAILABLE]++;
        return false;
    }
    // Link-aware: predicted local prefill (the step-time model) against the best link's queue +
    // remote prefill + transfer. Until the local step-time model is measured (two distinct prefill
    // step sizes), prefill locally: that is what measures it. No link measured yet: hand off (the
    // transfer measures the link).
    if (!e->params.disagg_link_aware) return true;
    pd_disagg_model dm;
    pd_engine_disagg_model(e, &dm);
    double remote_us = -1, local_us = pd_disagg_local_us(&dm, m.n_tokens);
    int best = pd_disagg_best_link(&dm, m.n_tokens, &remote_us);
    if (local_us < 0) {
        e->n_decide_local++;
        return false;
    }
    if (best < 0) return true;
    if (remote_us < local_us) {
        if (!e->params.on_prefill_enqueue) *worker = best;  // (queued: whoever claims it)
        e->n_decide_remote++;
        PD_LOG_D("engine: %d tokens: remote over %s (%.0f us) beats local (%.0f us)", m.n_tokens, dm.links[best].peer,
                 remote_us, local_us);
        return true;
    }
    e->n_decide_local++;
    PD_LOG_D("engine: %d tokens: local (%.0f us) beats remote over %s (%.0f us)", m.n_tokens, local_us,
             dm.links[best].peer, remote_us);
    return false;
}

// ---- decode side -------------------------------------------------------------------------------
static void fallback(pd_engine *e, ereq *q, pd_fallback_reason why, const char *detail) {
    pd_sched_event ev;
    q->is_loading = false;
    pd_status st = pd_sched_kv_loaded(e->sched, q->id, false, -1, &ev);
    if (q->is_aborted || st == PD_ERR_CLOSED) {
        pd_engine_req_remove(e, q->id);
        return;
    }
    e->n_fallbacks[why]++;
    PD_LOG_W("engine: request %llu: KV handoff failed (%s%s%s): prefilling locally", (unsigned long long)q->id,
             pd_fallback_reason_name(why), detail ? ": " : "", detail ? detail : "");
}

void pd_disagg_start_loads(pd_engine *e, const pd_step_plan *plan) {
    int bs = e->params.block_size;
    for (int i = 0; i < plan->n_kv_loads; i++) {
        const pd_step_kv_load *kl = &plan->kv_loads[i];
        ereq *q = pd_engine_req_find(e, kl->req_id);
        PD_ASSERT(q && q->prompt);
        int first_block = kl->n_tokens_local / bs;
        int nb = (kl->n_tokens + bs - 1) / bs - first_block;
        q->load_start = first_block * bs;
        q->n_load_blocks = nb;
        pd_free(q->load_blocks);
        q->load_blocks = pd_malloc(sizeof(int32_t) * (size_t)(nb > 0 ? nb : 1));
        q->is_loading = true;
        q->load_t0_us = pd_time_us();
        if (!q->t_sched_us) q->t_sched_us = q->load_t0_us;
        if (!q->load_blocks || nb <= 0) {
            fallback(e, q, PD_FALLBACK_ERROR, "out of memory");
            continue;
        }
        memcpy(q->load_blocks, kl->block_ids + first_block, sizeof(int32_t) * (size_t)nb);
        const pd_sampling_params *sp = &q->sampling;
        pd_kvconn_load l = {.req_id = q->id, .start_pos = q->load_start, .n_tokens = kl->n_tokens, .tokens = q->prompt,
                            .n_dst_blocks = nb, .dst_blocks = q->load_blocks,
                            .sampling = {.temperature = sp->temperature, .top_p = sp->top_p, .min_p = sp->min_p,
                                         .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
                                         .repetition_penalty = sp->repetition_penalty, .top_k = sp->top_k,
                                         .n_logprobs = sp->n_logprobs, .seed = sp->seed, .has_seed = sp->has_seed}};
        l.traceparent = q->traceparent;
        l.worker = q->kv_worker;
        if (pd_kvconn_start_load(e->kc, &l) != PD_OK) fallback(e, q, PD_FALLBACK_UNAVAILABLE, NULL);
    }
}

static void handle_load_done(pd_engine *e, pd_kvconn_event *ev) {
    ereq *q = pd_engine_req_find(e, ev->req_id);
    if (!q || !q->is_loading) return;  // a late duplicate
    if (q->is_aborted) {
        fallback(e, q, PD_FALLBACK_ERROR, NULL);  // frees the blocks; no event
        return;
    }
    if (ev->status != PD_OK) {
        pd_fallback_reason why = ev->status == PD_ERR_TIMEOUT ? PD_FALLBACK_TIMEOUT
                                 : ev->status == PD_ERR_CLOSED      ? PD_FALLBACK_WORKER_DIED
                                 : ev->status == PD_ERR_UNSUPPORTED ? PD_FALLBACK_POOL_REFUSED
                                                                    : PD_FALLBACK_ERROR;
        fallback(e, q, why, ev->reason);
        return;
    }
    const pd_kvw_prefill_done *d = &ev->done;
    const pd_model_config *c = pd_model_get_config(e->model);
    int64_t bytes = 0;
    if (!pd_kvconn_load_verify(e->kc, ev, q->load_blocks, q->n_load_blocks, q->load_start, q->n_prompt, c->vocab_size,
                               pd_time_us() - q->load_t0_us, &bytes)) {
        fallback(e, q, PD_FALLBACK_CHECKSUM, "KV checksum mismatch");
        return;
    }
    e->handoff_bytes += bytes;
    q->is_loading = false;
    PD_LOG_D("engine: request %llu: KV handoff of %d tokens took %.2f ms", (unsigned long long)q->id, q->n_prompt - q->load_start,
             (double)(pd_time_us() - q->load_t0_us) / 1000.0);
    e->n_handoffs++;
    e->handoff_us += pd_time_us() - q->load_t0_us;
    q->t_kv_ready_us = pd_time_us();
    q->is_kv_remote = true;
    q->remote_queue_us = d->queue_us;
    q->remote_compute_us = d->compute_us;
    pd_sampler_accept(q->sampler, d->first_token);
    // The first token was drawn remotely: continue its counter, so a seeded request draws the same
    // tokens handed off as prefilled here.
    pd_sampler_set_n_draws(q->sampler, d->n_draws);
    pd_sched_event sev;
    if (pd_sched_kv_loaded(e->sched, q->id, true, d->first_token, &sev) != PD_OK) {
        pd_engine_req_remove(e, q->id);
        return;
    }
    // The first token's logprobs were computed remotely; hand them on with the token event.
    pd_sample_result r = {.token = d->first_token, .logprob = d->logprob, .n_top = PD_MIN(d->n_top, PD_MAX_LOGPROBS)};
    for (int i = 0; i < r.n_top; i++) r.top_ids[i] = d->top_ids[i], r.top_logprobs[i] = d->top_logprobs[i];
    pd_step_seq seq = {.req_id = q->id, .needs_logits = true};
    pd_step_plan plan = {.n_seqs = 1, .seqs = &seq};
    pd_engine_push_sched_events(e, &plan, &r, &sev, 1);
}

// ---- prefill side ------------------------------------------------------------------------------
static void handle_save_request(pd_engine *e, pd_kvconn_event *ev) {
    const pd_kvw_prefill_req *r = &ev->req;
    PD_LOG_D("engine: prefill request %llu (%d tokens) from decode worker %d", (unsigned long long)r->req_id, r->n_tokens, ev->peer);
    const pd_model_config *c = pd_model_get_config(e->model);
    const char *bad = pd_kvconn_check_request(e->kc, ev, c->vocab_size);
    if (bad) return pd_kvconn_send_fail(e->kc, ev->peer, r->req_id, bad);
    pd_sampling_params sp = pd_sampling_params_default();
    sp.temperature = r->sampling.temperature, sp.top_p = r->sampling.top_p, sp.min_p = r->sampling.min_p;
    sp.presence_penalty = r->sampling.presence_penalty, sp.frequency_penalty = r->sampling.frequency_penalty;
    sp.repetition_penalty = r->sampling.repetition_penalty, sp.top_k = r->sampling.top_k;
    sp.n_logprobs = r->sampling.n_logprobs, sp.seed = r->sampling.seed, sp.has_seed = r->sampling.has_seed != 0;
    if (pd_sampling_params_validate(&sp, NULL)) return pd_kvconn_send_fail(e->kc, ev->peer, r->req_id, "bad sampling parameters");
    ereq *q = pd_calloc(1, sizeof *q);
    if (q) {
        q->sampler = pd_sampler_new(&sp, c->vocab_size);
        q->dst_blocks = pd_malloc(sizeof(int32_t) * (size_t)r->n_dst_blocks);
    }
    uint64_t id = e->next_internal_id++;
    pd_sched_req_params srp = {.req_id = id, .prompt = r->tokens, .n_prompt = r->n_tokens, .max_tokens = 1,
                               .ignore_eos = true, .is_hold_blocks = true};
    // The KV pool: a prefix some worker computed (Redis, or this worker's own DRAM / disk) is
    // loaded, not computed again.
    if (q) srp.n_tier_tokens = pd_tiers_req_init(e, q, r->tokens, r->n_tokens);
    pd_err err = {0};
    if (!q || !q->sampler || !q->dst_blocks || pd_engine_req_reserve(e) || pd_sched_add(e->sched, &srp, pd_time_us(), &err)) {
        if (q) {
            pd_sampler_free(q->sampler);
            pd_free(q->dst_blocks);
            pd_tiers_req_fini(q);
            pd_free(q);
        }
        return pd_kvconn_send_fail(e->kc, ev->peer, r->req_id, err.msg[0] ? err.msg : "out of memory");
    }
    pd_sampler_add_prompt(q->sampler, r->tokens, r->n_tokens);
    memcpy(q->dst_blocks, r->dst_blocks, sizeof(int32_t) * (size_t)r->n_dst_blocks);
    q->n_dst_blocks = r->n_dst_blocks;
    q->id = id;
    q->n_prompt = r->n_tokens;
    q->is_export = true;
    q->conn_id = ev->peer;
    q->peer_req_id = r->req_id;
    q->export_start = r->start_pos;
    q->t_arrival_us = pd_time_us();
    memcpy(q->traceparent, r->traceparent, sizeof q->traceparent);
    q->traceparent[sizeof q->traceparent - 1] = 0;
    pd_engine_req_insert(e, q);
    e->n_prompt_tokens += r->n_tokens;
}

static void on_layer(void *ud, int layer) {
    pd_engine *e = ud;
    if (e->n_saves) pd_kvconn_layer_begin(e->kc, layer);
    for (int i = 0; i < e->n_saves; i++) pd_kvconn_save_layer(e->kc, e->saves[i]->save, layer);
}

void pd_disagg_step_begin(pd_engine *e, const pd_step_plan *plan, pd_batch *batch) {
    e->n_saves = 0;
    if (!e->kc || e->params.role != PD_ROLE_PREFILL) return;
    int bs = e->params.block_size;
    for (int i = 0; i < plan->n_seqs; i++) {
        const pd_step_seq *s = &plan->seqs[i];
        ereq *q = pd_engine_req_find(e, s->req_id);
        if (!q || !q->is_export || q->is_aborted || q->save || s->pos_start + s->n_tokens != q->n_prompt) continue;
        int first_block = q->export_start / bs;
        if (s->n_blocks < first_block + q->n_dst_blocks) continue;  // (the export then checks and fails)
        if (PD_ARRAY_RESERVE(e->saves, e->cap_saves, (size_t)e->n_saves + 1))
            break;  // those requests save everything at the end instead
        q->save = pd_kvconn_save_begin(e->kc, q->conn_id, q->peer_req_id, s->block_ids + first_block, q->dst_blocks,
                                       q->n_dst_blocks, q->export_start, q->n_prompt);
        if (q->save) e->saves[e->n_saves++] = q;
    }
    if (e->n_saves) {
        batch->on_layer = on_layer;
        batch->on_layer_ud = e;
    }
}

void pd_disagg_step_failed(pd_engine *e, uint64_t req_id) {
    ereq *q = pd_engine_req_find(e, req_id);
    if (!q || !q->is_export) return;
    // Tell the decode worker now (it would otherwise wait for its timeout).
    if (q->save) pd_kvconn_save_fail(e->kc, q->save, "prefill step failed", !q->is_aborted);
    else if (!q->is_aborted) pd_kvconn_send_fail(e->kc, q->conn_id, q->peer_req_id, "prefill step failed");
    q->save = NULL;
    pd_sched_abort(e->sched, q->id);
    pd_engine_req_remove(e, q->id);
}

// The prefill worker's spans of one export (metrics/trace.h), children of the decode worker's
// request span named in PREFILL_REQ: queue, compute (the prompt's forward), export (KV out).
static void trace_export(pd_engine *e, const ereq *q, int64_t t_sched, int64_t t_ready) {
    pd_trace_ctx parent;
    if (!pd_trace_enabled() || pd_traceparent_parse(q->traceparent, &parent) != PD_OK) return;
    uint8_t span[8], child[8];
    pd_trace_new_span_id(span);
    int64_t now = pd_time_us();
    char attrs[160];
    snprintf(attrs, sizeof attrs, "\"tokens\":%d,\"start_pos\":%d,\"queue_ms\":%.3f,\"compute_ms\":%.3f", q->n_prompt,
             q->export_start, (double)(t_sched - q->t_arrival_us) / 1e3, (double)(t_ready - t_sched) / 1e3);
    pd_trace_span(parent.trace_id, span, parent.span_id, "prefill_worker.prefill", q->t_arrival_us, now, attrs);
    pd_trace_new_span_id(child);
    pd_trace_span(parent.trace_id, child, span, "prefill.queue", q->t_arrival_us, t_sched, NULL);
    pd_trace_new_span_id(child);
    pd_trace_span(parent.trace_id, child, span, "prefill.compute", t_sched, t_ready, NULL);
    pd_trace_new_span_id(child);
    pd_trace_span(parent.trace_id, child, span, "prefill.kv_export", t_ready, now, NULL);
    PD_UNUSED(e);
}

void pd_disagg_export(pd_engine *e, ereq *q, const pd_sched_event *ev, const pd_sample_result *first) {
    PD_LOG_D("engine: exporting request %llu (%d tokens)", (unsigned long long)q->peer_req_id, q->n_prompt);
    int bs = e->params.block_size;
    int first_block = q->export_start / bs, nb = q->n_dst_blocks;
    if (e->params.debug_export_delay_ms > 0) poll(NULL, 0, e->params.debug_export_delay_ms);  // test hook: slow worker
    if (!q->save && !q->is_aborted && ev->n_blocks >= first_block + nb)  // (no save began: one now, all layers at once)
        q->save = pd_kvconn_save_begin(e->kc, q->conn_id, q->peer_req_id, ev->block_ids + first_block, q->dst_blocks, nb,
                                       q->export_start, q->n_prompt);
    if (q->is_aborted) {
        pd_kvconn_save_fail(e->kc, q->save, "aborted", false);
    } else if (!q->save) {
        pd_kvconn_send_fail(e->kc, q->conn_id, q->peer_req_id, "KV export failed");
    } else {
        int64_t t_sched = q->t_sched_us ? q->t_sched_us : q->t_arrival_us;
        int64_t t_ready = q->t_kv_ready_us ? q->t_kv_ready_us : t_sched;
        pd_kvconn_first f = {.token = first->token, .logprob = first->logprob, .n_top = first->n_top,
                             .top_ids = first->top_ids, .top_logprobs = first->top_logprobs,
                             .n_draws = pd_sampler_n_draws(q->sampler), .queue_us = t_sched - q->t_arrival_us,
                             .compute_us = t_ready - t_sched};
        int64_t us = 0;
        if (pd_kvconn_save_end(e->kc, q->save, &f, &us) == PD_OK) {
            const pd_model_config *c = pd_model_get_config(e->model);
            size_t row_bytes = pd_model_kv_row_bytes(e->model);
            e->export_bytes += (int64_t)(2 * (size_t)c->n_layers * (size_t)(q->n_prompt - q->export_start) * row_bytes);
            e->n_exports++;
            trace_export(e, q, t_sched, t_ready);
        }
        e->export_copy_us += us;
    }
    q->save = NULL;
    pd_sched_release(e->sched, q->id);
    pd_engine_req_remove(e, q->id);
}

void pd_disagg_abort(pd_engine *e, ereq *q) {
    q->is_aborted = true;
    if (q->is_loading) {
        // The prefill worker may be writing into our blocks right now: they stay reserved (the
        // scheduler keeps them) until its answer to the CANCEL, or a fenced failure, ends the load.
        pd_sched_abort(e->sched, q->id);
        pd_kvconn_request_finished(e->kc, q->id);
    } else if (q->is_export) {
        if (q->save) pd_kvconn_save_fail(e->kc, q->save, "aborted", false);
        q->save = NULL;
        pd_sched_abort(e->sched, q->id);
        pd_engine_req_remove(e, q->id);
    }
}

void pd_disagg_handle(pd_engine *e, pd_kvconn_event *ev) {
    switch (ev->kind) {
    case PD_KVCONN_EV_LOAD_DONE: handle_load_done(e, ev); break;
    case PD_KVCONN_EV_TIER_LOADED: pd_tiers_handle(e, ev); break;  // (engine.c routes it there first)
    case PD_KVCONN_EV_PEER_UP: pd_kvconn_peer_up(e->kc, ev); break;
    case PD_KVCONN_EV_SAVE_REQUEST: handle_save_request(e, ev); break;
    case PD_KVCONN_EV_CANCEL:
    case PD_KVCONN_EV_PEER_DOWN:
        // Abort the requests of that peer (one, or all on PEER_DOWN).
        // An abort here removes the request, and the map's delete may shift a later entry into
        // slot i (or wrap one already seen, which does not match, to the end): slot i is looked
        // at again after each abort, so every entry is seen.
        for (size_t i = 0; i < pd_engine_req_cap(e); i++) {
            ereq *q = pd_engine_req_at(e, i);
            if (!q || !q->is_export || q->conn_id != ev->peer || (ev->kind == PD_KVCONN_EV_CANCEL && q->peer_req_id != ev->req_id))
                continue;
            // Not exported yet (exports finish within a step): say so, so the decode worker
            // frees the blocks it reserved.
            if (ev->kind == PD_KVCONN_EV_CANCEL) pd_kvconn_send_fail(e->kc, q->conn_id, q->peer_req_id, "cancelled");
            pd_disagg_abort(e, q);                     // removes q (an export)
            if (pd_engine_req_at(e, i) != q) i--;      // look at slot i again (0 - 1 wraps, ++ gives 0)
        }
        if (ev->kind == PD_KVCONN_EV_PEER_DOWN) pd_kvconn_peer_down(e->kc, ev);
        break;
    }
}
