// disagg.c — the engine's half of disaggregated prefill/decode.
//
// Decode role (owns the request):
//   submit ─► want_remote? (uncached prompt tokens >= disagg_min_tokens and a healthy prefill
//   worker) ─► pd_sched_add(is_remote_prefill) ─► the scheduler reserves blocks for the whole
//   prompt and lists a kv_load ─► start_loads sends PREFILL_REQ (prompt, first uncached position,
//   the reserved blocks) ─► ... ─► RESULT: verify the per-layer checksums over our own blocks ─►
//   pd_sched_kv_loaded(ok, first token) and decode; any failure (worker unavailable, died, timed
//   out, refused, checksum mismatch) ─► pd_sched_kv_loaded(!ok): the prompt is prefilled locally
//   from its prefix-cache hit, counted as a fallback with its reason. KV that failed verification
//   is never decoded from.
//
// Prefill role (serves decode workers):
//   HELLO ─► map the decode pool (shm / cuda-ipc) ─► PREFILL_REQ ─► an internal request
//   (max_tokens 1, is_hold_blocks) ─► the engine prefills it like any other (own prefix cache,
//   chunking, batching) ─► when it finishes, export: copy the KV rows of [start, n) into the
//   decode worker's blocks (or send them as KV_SLAB frames over tcp), checksum our source blocks,
//   send PREFILL_DONE with the first token, release the blocks.
//
// Transports: tcp (KV_SLAB frames), shm / cuda-ipc (direct writes into the decode pool), nccl (the
// request's rows gathered into one staging slab on the compute stream, then ncclSend on the
// connection's communicator; the decode side's xfer thread receives and scatters it).
//
// NOTE(lead): the export runs after the step that completes the prompt, not layer by layer; with
// cuda-ipc the copy is one device-to-device pass per layer on the compute stream. With nccl the
// prefill engine thread waits for the send to complete (bounded by disagg_timeout_ms), as it
// waits for the cuda-ipc copy.
#include "metrics/trace.h"
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "engine/engine_impl.h"

const char *pd_fallback_reason_name(pd_fallback_reason r) {
    static const char *n[] = {"unavailable", "timeout", "worker_died", "checksum", "error"};
    return r < PD_FALLBACK_N ? n[r] : "unknown";
}

int pd_engine_kv_port(const pd_engine *e) { return e->xs ? pd_xfer_server_port(e->xs) : 0; }
int pd_engine_n_prefill_healthy(pd_engine *e) { return e->xc ? pd_xfer_client_n_healthy(e->xc) : 0; }
pd_kvw_transport pd_engine_kv_transport(const pd_engine *e) { return e->params.kv_transport; }

static pd_kvw_fingerprint fingerprint(pd_engine *e) {
    const pd_model_config *c = pd_model_get_config(e->model);
    pd_kvw_fingerprint f = {.arch = (uint32_t)c->arch, .n_layers = (uint32_t)c->n_layers, .n_heads = (uint32_t)c->n_heads,
                            .n_kv_heads = (uint32_t)c->n_kv_heads, .head_dim = (uint32_t)c->head_dim,
                            .hidden = (uint32_t)c->hidden_size, .vocab = (uint32_t)c->vocab_size,
                            .kv_dtype = (uint32_t)pd_backend_act_dtype(e->backend), .block_size = (uint32_t)e->params.block_size};
    // The weights' metadata: every shape-determining field, the RoPE setup and the total weight
    // bytes; dummy weights also hash their seed origin, so dummy and real never mix.
    // Hashed as explicit doubles (no struct padding in the hash input).
    double meta[] = {c->rope_theta, c->rope_factor, c->rms_norm_eps, c->intermediate_size, c->max_position_embeddings,
                     (double)c->rope_type, c->tie_word_embeddings, c->attention_bias, e->params.dummy_weights,
                     (double)(pd_model_weight_bytes(e->model) / pd_dtype_size(pd_backend_weight_dtype(e->backend)))};
    f.weights_hash = XXH3_64bits(&meta, sizeof meta);
    return f;
}

// Called on xfer I/O threads: move the event into the engine's command queue.
static void on_xfer_event(void *ud, pd_xfer_event *ev) {
    pd_engine *e = ud;
    pd_cmd *c = pd_calloc(1, sizeof *c);
    if (!c) {
        PD_LOG_E("engine: out of memory queueing a KV transfer event (request %llu)", (unsigned long long)ev->req_id);
        return;
    }
    c->kind = PD_CMD_XFER;
    c->xev = *ev;
    ev->owned = NULL;  // moved
    pd_queue_push_cmd(&e->q, c);
}

pd_status pd_disagg_init(pd_engine *e, pd_err *err) {
    const pd_engine_params *p = &e->params;
    const pd_model_config *c = pd_model_get_config(e->model);
    if (p->role == PD_ROLE_DECODE && p->n_prefill_addrs > 0) {
        pd_xfer_client_params cp = {0};
        cp.n_workers = p->n_prefill_addrs;
        for (int i = 0; i < p->n_prefill_addrs && i < PD_XFER_MAX_WORKERS; i++) cp.addrs[i] = p->prefill_addrs[i];
        cp.transport = p->kv_transport;
        cp.fp = fingerprint(e);
        if (p->kv_transport == PD_KVW_TRANSPORT_NCCL && pd_comm_id_new(e->backend, NULL, err))
            return err ? err->status : PD_ERR_UNSUPPORTED;
        if ((p->kv_transport == PD_KVW_TRANSPORT_SHM || p->kv_transport == PD_KVW_TRANSPORT_CUDA_IPC) &&
            pd_buffer_export(pd_model_cache_buffer(e->cache), &cp.pool_handle))
            return pd_err_set(err, PD_ERR_UNSUPPORTED, "the KV pool cannot be exported for %s", pd_kvw_transport_name(p->kv_transport));
        if (p->kv_transport == PD_KVW_TRANSPORT_TCP && strcmp(pd_backend_name(e->backend), "cpu"))
            return pd_err_set(err, PD_ERR_UNSUPPORTED, "the tcp KV transport needs a CPU KV pool; use cuda-ipc on GPUs");
        cp.pool = (pd_xfer_pool){.n_layers = c->n_layers, .n_blocks = pd_model_cache_n_blocks(e->cache),
                                 .block_size = e->params.block_size,
                                 .row_bytes = (size_t)c->n_kv_heads * (size_t)c->head_dim * pd_dtype_size(pd_backend_act_dtype(e->backend)),
                                 .k = e->layer_k, .v = e->layer_v};
        cp.backend = e->backend;
        cp.timeout_ms = p->disagg_timeout_ms;
        cp.on_event = on_xfer_event;
        cp.ud = e;
        e->xc = pd_xfer_client_new(&cp, err);
        if (!e->xc) return err ? err->status : PD_ERR_IO;
        PD_LOG_I("engine: decode role, %d prefill worker(s), KV transport %s, disagg-min-tokens %d", p->n_prefill_addrs,
                 pd_kvw_transport_name(p->kv_transport), p->disagg_min_tokens);
    } else if (p->role == PD_ROLE_PREFILL) {
        pd_xfer_server_params sp = {.host = p->kv_host, .port = p->kv_port, .fp = fingerprint(e), .backend = e->backend,
                                    .on_event = on_xfer_event, .ud = e};
        e->xs = pd_xfer_server_new(&sp, err);
        if (!e->xs) return err ? err->status : PD_ERR_IO;
        PD_LOG_I("engine: prefill role, KV port %d", pd_xfer_server_port(e->xs));
    }
    e->next_internal_id = 1ull << 62;
    return PD_OK;
}

void pd_disagg_fini(pd_engine *e) {
    pd_xfer_client_free(e->xc);
    e->xc = NULL;
    pd_xfer_server_free(e->xs);
    e->xs = NULL;
    for (size_t i = 0; i < PD_ARRAY_LEN(e->peers); i++)
        if (e->peers[i].base) pd_backend_unimport(e->backend, e->peers[i].base, &e->peers[i].handle);
    memset(e->peers, 0, sizeof e->peers);
}

void pd_disagg_req_fini(ereq *q) {
    pd_free(q->prompt);
    pd_free(q->load_blocks);
    pd_free(q->dst_blocks);
    q->prompt = q->load_blocks = q->dst_blocks = NULL;
}

bool pd_disagg_want_remote(pd_engine *e, const int32_t *prompt, int n_prompt) {
    if (!e->xc) return false;
    pd_kv_seq tmp;
    pd_kv_seq_init(&tmp, 0);
    int32_t hit = pd_kv_peek_computed(e->kv, &tmp, prompt, n_prompt);
    pd_kv_seq_fini(&tmp);
    if (hit < 0) hit = 0;
    if (n_prompt - hit < e->params.disagg_min_tokens) {
        e->n_local_short++;
        return false;
    }
    if (pd_xfer_client_n_healthy(e->xc) == 0) {
        e->n_fallbacks[PD_FALLBACK_UNAVAILABLE]++;
        return false;
    }
    return true;
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
        pd_kvw_prefill_req r = {.req_id = q->id, .start_pos = q->load_start, .n_tokens = kl->n_tokens, .tokens = q->prompt,
                                .n_dst_blocks = nb, .dst_blocks = q->load_blocks,
                                .sampling = {.temperature = sp->temperature, .top_p = sp->top_p, .min_p = sp->min_p,
                                             .presence_penalty = sp->presence_penalty, .frequency_penalty = sp->frequency_penalty,
                                             .repetition_penalty = sp->repetition_penalty, .top_k = sp->top_k,
                                             .n_logprobs = sp->n_logprobs, .seed = sp->seed, .has_seed = sp->has_seed}};
        memcpy(r.traceparent, q->traceparent, sizeof r.traceparent);
        if (pd_xfer_client_prefill(e->xc, &r) != PD_OK) fallback(e, q, PD_FALLBACK_UNAVAILABLE, NULL);
    }
}

// Verifies the per-layer checksums of what landed in our blocks.
static bool verify(pd_engine *e, ereq *q, const pd_kvw_prefill_done *d) {
    const pd_model_config *c = pd_model_get_config(e->model);
    if (d->n_layers != c->n_layers) return false;
    int bs = e->params.block_size;
    int32_t *rows = pd_malloc(sizeof(int32_t) * (size_t)q->n_load_blocks);
    uint64_t *sums = pd_malloc(sizeof(uint64_t) * (size_t)c->n_layers);
    bool ok = rows && sums;
    if (ok) {
        for (int i = 0; i < q->n_load_blocks; i++) rows[i] = PD_MIN(bs, q->n_prompt - (q->load_start + i * bs));
        pd_kv_checksum_params cp = {.k = e->layer_k, .v = e->layer_v, .blocks = q->load_blocks, .n_rows = rows,
                                    .n_blocks = q->n_load_blocks, .layer_begin = 0, .layer_end = c->n_layers,
                                    .block_size = bs, .row_bytes = (size_t)c->n_kv_heads * (size_t)c->head_dim *
                                                                   pd_dtype_size(pd_backend_act_dtype(e->backend)),
                                    .sums = sums};
        pd_op_kv_checksum(e->backend, &cp);
        for (int l = 0; l < c->n_layers && ok; l++) ok = sums[l] == d->checksums[l];
        e->handoff_bytes += (int64_t)(2 * (size_t)c->n_layers * cp.row_bytes * (size_t)(q->n_prompt - q->load_start));
    }
    pd_free(rows);
    pd_free(sums);
    return ok;
}

static void handle_result(pd_engine *e, pd_xfer_event *ev) {
    ereq *q = pd_engine_req_find(e, ev->req_id);
    if (!q || !q->is_loading) return;  // a late duplicate
    if (q->is_aborted) {
        fallback(e, q, PD_FALLBACK_ERROR, NULL);  // frees the blocks; no event
        return;
    }
    if (ev->status != PD_OK) {
        pd_fallback_reason why = ev->status == PD_ERR_TIMEOUT ? PD_FALLBACK_TIMEOUT
                                 : ev->status == PD_ERR_CLOSED ? PD_FALLBACK_WORKER_DIED
                                                               : PD_FALLBACK_ERROR;
        fallback(e, q, why, ev->reason);
        return;
    }
    const pd_kvw_prefill_done *d = &ev->done;
    const pd_model_config *c = pd_model_get_config(e->model);
    if (d->first_token < 0 || d->first_token >= c->vocab_size || !verify(e, q, d)) {
        fallback(e, q, PD_FALLBACK_CHECKSUM, "KV checksum mismatch");
        return;
    }
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
static void send_fail(pd_engine *e, int conn, uint64_t peer_id, const char *why) {
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_FAIL};
    m.u.fail.req_id = peer_id;
    snprintf(m.u.fail.reason, sizeof m.u.fail.reason, "%.200s", why);
    pd_xfer_server_send(e->xs, conn, &m, NULL);
}

static void handle_hello(pd_engine *e, pd_xfer_event *ev) {
    if (ev->conn_id < 0 || ev->conn_id >= (int)PD_ARRAY_LEN(e->peers)) return;
    struct peer_pool *pp = &e->peers[ev->conn_id];
    memset(pp, 0, sizeof *pp);
    pp->transport = (pd_kvw_transport)ev->hello.transport;
    pp->n_blocks = (int)ev->hello.pool_n_blocks;
    if (pp->transport == PD_KVW_TRANSPORT_SHM || pp->transport == PD_KVW_TRANSPORT_CUDA_IPC) {
        if (ev->hello.handle_len != sizeof pp->handle) {
            PD_LOG_W("engine: decode worker %d sent a bad pool handle", ev->conn_id);
            return;
        }
        memcpy(&pp->handle, ev->hello.handle, sizeof pp->handle);
        pd_err err = {0};
        pp->base = pd_backend_import(e->backend, &pp->handle, &err);
        if (!pp->base) {
            PD_LOG_W("engine: cannot map decode worker %d's KV pool: %s", ev->conn_id, err.msg);
            return;
        }
    }
    pp->is_mapped = true;
    PD_LOG_I("engine: decode worker %d connected (KV transport %s)", ev->conn_id, pd_kvw_transport_name(pp->transport));
}

static void handle_request(pd_engine *e, pd_xfer_event *ev) {
    PD_LOG_D("engine: prefill request %llu (%d tokens) from decode worker %d", (unsigned long long)ev->req.req_id, ev->req.n_tokens, ev->conn_id);
    const pd_kvw_prefill_req *r = &ev->req;
    const pd_model_config *c = pd_model_get_config(e->model);
    int bs = e->params.block_size;
    struct peer_pool *pp = ev->conn_id >= 0 && ev->conn_id < (int)PD_ARRAY_LEN(e->peers) ? &e->peers[ev->conn_id] : NULL;
    if (!pp || !pp->is_mapped) return send_fail(e, ev->conn_id, r->req_id, "decode pool not mapped");
    int need = (r->n_tokens + bs - 1) / bs - r->start_pos / bs;
    if (r->start_pos % bs || r->n_dst_blocks != need) return send_fail(e, ev->conn_id, r->req_id, "bad block list");
    for (int i = 0; i < r->n_dst_blocks; i++)
        if (r->dst_blocks[i] < 0 || (pp->transport != PD_KVW_TRANSPORT_TCP && r->dst_blocks[i] >= pp->n_blocks))
            return send_fail(e, ev->conn_id, r->req_id, "destination block out of range");
    for (int i = 0; i < r->n_tokens; i++)
        if (r->tokens[i] < 0 || r->tokens[i] >= c->vocab_size) return send_fail(e, ev->conn_id, r->req_id, "token id out of range");
    ereq *q = pd_calloc(1, sizeof *q);
    pd_sampling_params sp = pd_sampling_params_default();
    sp.temperature = r->sampling.temperature, sp.top_p = r->sampling.top_p, sp.min_p = r->sampling.min_p;
    sp.presence_penalty = r->sampling.presence_penalty, sp.frequency_penalty = r->sampling.frequency_penalty;
    sp.repetition_penalty = r->sampling.repetition_penalty, sp.top_k = r->sampling.top_k;
    sp.n_logprobs = r->sampling.n_logprobs, sp.seed = r->sampling.seed, sp.has_seed = r->sampling.has_seed != 0;
    if (pd_sampling_params_validate(&sp, NULL)) sp = pd_sampling_params_default();
    if (q) {
        q->sampler = pd_sampler_new(&sp, c->vocab_size);
        q->dst_blocks = pd_malloc(sizeof(int32_t) * (size_t)r->n_dst_blocks);
    }
    uint64_t id = e->next_internal_id++;
    pd_sched_req_params srp = {.req_id = id, .prompt = r->tokens, .n_prompt = r->n_tokens, .max_tokens = 1,
                               .ignore_eos = true, .is_hold_blocks = true};
    pd_err err = {0};
    if (!q || !q->sampler || !q->dst_blocks || pd_sched_add(e->sched, &srp, pd_time_us(), &err)) {
        if (q) {
            pd_sampler_free(q->sampler);
            pd_free(q->dst_blocks);
            pd_free(q);
        }
        return send_fail(e, ev->conn_id, r->req_id, err.msg[0] ? err.msg : "out of memory");
    }
    pd_sampler_add_prompt(q->sampler, r->tokens, r->n_tokens);
    memcpy(q->dst_blocks, r->dst_blocks, sizeof(int32_t) * (size_t)r->n_dst_blocks);
    q->n_dst_blocks = r->n_dst_blocks;
    q->id = id;
    q->n_prompt = r->n_tokens;
    q->is_export = true;
    q->conn_id = ev->conn_id;
    q->peer_req_id = r->req_id;
    q->export_start = r->start_pos;
    q->t_arrival_us = pd_time_us();
    memcpy(q->traceparent, r->traceparent, sizeof q->traceparent);
    q->traceparent[sizeof q->traceparent - 1] = 0;
    pd_engine_req_insert(e, q);
    e->n_prompt_tokens += r->n_tokens;
}

// nccl: the staging slab is laid out like a cache of nb blocks (wire/kv.h, KV_NCCL): slab block i
// = the request's i-th block. Runs on the compute stream; the send waits for it on the device.
typedef struct gather_ctx {
    pd_engine *e;
    const pd_kvw_kv_nccl *slab;
    const int32_t *src, *rows;
    bool corrupt;
    int64_t us;  // out: the gather's time (host clock, synchronised)
} gather_ctx;

static void gather_slab(void *ud, void *dev) {
    gather_ctx *g = ud;
    pd_engine *e = g->e;
    int64_t t0 = pd_time_us();
    const pd_kvw_kv_nccl *s = g->slab;
    int L = s->n_layers, nb = s->n_blocks;
    void **dk = pd_malloc(sizeof(void *) * 2 * (size_t)L);
    int32_t *idx = pd_malloc(sizeof(int32_t) * (size_t)nb);
    PD_ASSERT(dk && idx);
    pd_kvw_kv_nccl_layers(s, dev, dk, dk + L);
    for (int i = 0; i < nb; i++) idx[i] = i;
    pd_kv_copy_params kp = {.src_k = e->layer_k, .src_v = e->layer_v, .dst_k = dk, .dst_v = dk + L, .src_blocks = g->src,
                            .dst_blocks = idx, .n_rows = g->rows, .n_blocks = nb, .layer_begin = 0, .layer_end = L,
                            .block_size = s->block_size, .row_bytes = (size_t)s->row_bytes};
    pd_op_kv_copy(e->backend, &kp);
    if (g->corrupt) {  // test hook: flip one bit of the last layer's V rows in the slab
        uint8_t x;
        char *at = (char *)dk[2 * L - 1];
        pd_backend_download(e->backend, &x, at, 1);
        x ^= 0x40;
        pd_backend_upload(e->backend, at, &x, 1);
    }
    // Synchronised only to time the send alone (the send would wait for the gather anyway).
    pd_backend_sync(e->backend);
    g->us = pd_time_us() - t0;
    pd_free(dk);
    pd_free(idx);
}

static pd_status send_nccl(pd_engine *e, ereq *q, const int32_t *src, const int32_t *rows, int nb, size_t row_bytes,
                           bool corrupt) {
    const pd_model_config *c = pd_model_get_config(e->model);
    int bs = e->params.block_size;
    pd_kvw_kv_nccl slab = {.req_id = q->peer_req_id, .n_layers = c->n_layers, .n_blocks = nb, .block_size = bs,
                           .n_rows_last = rows[nb - 1], .row_bytes = row_bytes};
    slab.bytes = (uint64_t)c->n_layers * 2u * (uint64_t)nb * (uint64_t)bs * row_bytes;
    gather_ctx g = {.e = e, .slab = &slab, .src = src, .rows = rows, .corrupt = corrupt};
    pd_err err = {0};
    int64_t t0 = pd_time_us();
    pd_status st = pd_xfer_server_send_nccl(e->xs, q->conn_id, &slab, gather_slab, &g, e->params.disagg_timeout_ms, &err);
    if (st) {
        PD_LOG_W("engine: request %llu: nccl KV export failed: %s", (unsigned long long)q->peer_req_id, err.msg);
        return st;
    }
    // The transfer alone: announcement + ncclSend until the peer has it (the local gather excluded).
    int64_t us = pd_time_us() - t0 - g.us;
    e->export_copy_us += us;
    PD_LOG_D("engine: request %llu: nccl slab of %llu bytes: gather %.3f ms, send %.3f ms",
             (unsigned long long)q->peer_req_id, (unsigned long long)slab.bytes, (double)g.us / 1000.0, (double)us / 1000.0);
    for (int i = 0; i < nb; i++) e->export_bytes += (int64_t)(2 * (size_t)c->n_layers * (size_t)rows[i] * row_bytes);
    return PD_OK;
}

// tcp: one KV_SLAB frame per layer, K rows of every block then V rows (the checksum's order).
static pd_status send_slabs(pd_engine *e, ereq *q, const int32_t *src, const int32_t *rows, int nb, size_t row_bytes,
                            bool corrupt) {
    const pd_model_config *c = pd_model_get_config(e->model);
    size_t total_rows = 0;
    for (int i = 0; i < nb; i++) total_rows += (size_t)rows[i];
    size_t len = 2 * total_rows * row_bytes, bb = row_bytes * (size_t)e->params.block_size;
    uint8_t *payload = pd_malloc(len);
    if (!payload) return PD_ERR_NOMEM;
    pd_status st = PD_OK;
    for (int l = 0; l < c->n_layers && st == PD_OK; l++) {
        uint8_t *o = payload;
        for (int kv = 0; kv < 2; kv++)
            for (int i = 0; i < nb; i++) {
                size_t n = row_bytes * (size_t)rows[i];
                pd_backend_download(e->backend, o, (char *)(kv ? e->layer_v[l] : e->layer_k[l]) + (size_t)src[i] * bb, n);
                o += n;
            }
        if (corrupt && l == c->n_layers - 1) payload[len / 2] ^= 0x40;  // test hook: one flipped bit
        pd_kvw_msg m = {.type = PD_KVW_KV_SLAB};
        m.u.kv_slab = (pd_kvw_kv_slab){.req_id = q->peer_req_id, .layer = l, .n_blocks = nb, .n_rows_last = rows[nb - 1],
                                       .row_bytes = row_bytes, .payload_len = len};
        st = pd_xfer_server_send(e->xs, q->conn_id, &m, payload);
    }
    pd_free(payload);
    return st;
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
    const pd_model_config *c = pd_model_get_config(e->model);
    int bs = e->params.block_size, L = c->n_layers;
    struct peer_pool *pp = &e->peers[q->conn_id];
    int first_block = q->export_start / bs, nb = q->n_dst_blocks;
    size_t row_bytes = (size_t)c->n_kv_heads * (size_t)c->head_dim * pd_dtype_size(pd_backend_act_dtype(e->backend));
    int32_t *rows = pd_malloc(sizeof(int32_t) * (size_t)nb);
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_DONE};
    pd_kvw_prefill_done *d = &m.u.done;
    pd_status st = rows && pp->is_mapped && ev->n_blocks >= first_block + nb && L <= PD_KVW_MAX_LAYERS ? PD_OK : PD_ERR_INVALID;
    bool corrupt = e->params.debug_corrupt_every > 0 && ++e->n_corrupt_counter % e->params.debug_corrupt_every == 0;
    if (e->params.debug_export_delay_ms > 0) poll(NULL, 0, e->params.debug_export_delay_ms);  // test hook: slow worker
    if (st == PD_OK && !q->is_aborted) {
        const int32_t *src = ev->block_ids + first_block;
        for (int i = 0; i < nb; i++) rows[i] = PD_MIN(bs, q->n_prompt - (q->export_start + i * bs));
        pd_kv_checksum_params cp = {.k = e->layer_k, .v = e->layer_v, .blocks = src, .n_rows = rows, .n_blocks = nb,
                                    .layer_begin = 0, .layer_end = L, .block_size = bs, .row_bytes = row_bytes,
                                    .sums = d->checksums};
        pd_op_kv_checksum(e->backend, &cp);
        if (pp->transport == PD_KVW_TRANSPORT_TCP) {
            st = send_slabs(e, q, src, rows, nb, row_bytes, corrupt);
        } else if (pp->transport == PD_KVW_TRANSPORT_NCCL) {
            st = send_nccl(e, q, src, rows, nb, row_bytes, corrupt);
        } else {
            // Direct write into the decode worker's pool: same layout, its layer stride.
            size_t layer_stride = (size_t)pp->n_blocks * row_bytes * (size_t)bs;
            void **dk = pd_malloc(sizeof(void *) * (size_t)L), **dv = pd_malloc(sizeof(void *) * (size_t)L);
            if (dk && dv) {
                for (int l = 0; l < L; l++) {
                    dk[l] = (char *)pp->base + (size_t)(2 * l) * layer_stride;
                    dv[l] = (char *)pp->base + (size_t)(2 * l + 1) * layer_stride;
                }
                pd_kv_copy_params kp = {.src_k = e->layer_k, .src_v = e->layer_v, .dst_k = dk, .dst_v = dv, .src_blocks = src,
                                        .dst_blocks = q->dst_blocks, .n_rows = rows, .n_blocks = nb, .layer_begin = 0,
                                        .layer_end = L, .block_size = bs, .row_bytes = row_bytes};
                // Timed alone: the checksum above has synchronised, so the stream is idle here.
                int64_t t0 = pd_time_us();
                pd_op_kv_copy(e->backend, &kp);
                pd_backend_sync(e->backend);
                e->export_copy_us += pd_time_us() - t0;
                for (int i = 0; i < nb; i++) e->export_bytes += (int64_t)(2 * (size_t)L * (size_t)rows[i] * row_bytes);
                if (corrupt) {  // test hook: flip one bit of the copied V rows in the decode pool
                    uint8_t x;
                    char *at = (char *)dv[L - 1] + (size_t)q->dst_blocks[0] * row_bytes * (size_t)bs;
                    pd_backend_download(e->backend, &x, at, 1);
                    x ^= 0x40;
                    pd_backend_upload(e->backend, at, &x, 1);
                }
                pd_backend_sync(e->backend);  // the KV must be in place before DONE leaves
            } else {
                st = PD_ERR_NOMEM;
            }
            pd_free(dk);
            pd_free(dv);
        }
    }
    if (!q->is_aborted) {
        if (st == PD_OK) {
            d->req_id = q->peer_req_id;
            d->first_token = first->token;
            d->logprob = first->logprob;
            d->n_top = PD_MIN(first->n_top, PD_KVW_MAX_TOP);
            for (int i = 0; i < d->n_top; i++) d->top_ids[i] = first->top_ids[i], d->top_logprobs[i] = first->top_logprobs[i];
            d->n_layers = L;
            d->n_tokens_computed = q->n_prompt;
            int64_t t_sched = q->t_sched_us ? q->t_sched_us : q->t_arrival_us;
            int64_t t_ready = q->t_kv_ready_us ? q->t_kv_ready_us : t_sched;
            d->queue_us = t_sched - q->t_arrival_us;
            d->compute_us = t_ready - t_sched;
            pd_xfer_server_send(e->xs, q->conn_id, &m, NULL);
            e->n_exports++;
            trace_export(e, q, t_sched, t_ready);
        } else {
            send_fail(e, q->conn_id, q->peer_req_id, "KV export failed");
        }
    }
    pd_free(rows);
    pd_sched_release(e->sched, q->id);
    pd_engine_req_remove(e, q->id);
}

void pd_disagg_abort(pd_engine *e, ereq *q) {
    q->is_aborted = true;
    if (q->is_loading) {
        // The prefill worker may be writing into our blocks right now: they stay reserved (the
        // scheduler keeps them) until its answer to the CANCEL, or a failure, ends the transfer.
        pd_sched_abort(e->sched, q->id);
        pd_xfer_client_cancel(e->xc, q->id);
    } else if (q->is_export) {
        pd_sched_abort(e->sched, q->id);
        pd_engine_req_remove(e, q->id);
    }
}

void pd_disagg_handle(pd_engine *e, pd_xfer_event *ev) {
    switch (ev->kind) {
    case PD_XFER_EV_RESULT: handle_result(e, ev); break;
    case PD_XFER_EV_HELLO: handle_hello(e, ev); break;
    case PD_XFER_EV_REQUEST: handle_request(e, ev); break;
    case PD_XFER_EV_CANCEL:
    case PD_XFER_EV_CLOSED:
        // Abort the requests of that peer (one, or all on CLOSED).
        for (int b = 0; b < 4096; b++)
            for (ereq *q = e->buckets[b], *n; q; q = n) {
                n = q->next;
                if (q->is_export && q->conn_id == ev->conn_id && (ev->kind == PD_XFER_EV_CLOSED || q->peer_req_id == ev->req_id)) {
                    // Not exported yet (exports finish within a step): say so, so the decode
                    // worker frees the blocks it reserved.
                    if (ev->kind == PD_XFER_EV_CANCEL) send_fail(e, q->conn_id, q->peer_req_id, "cancelled");
                    pd_disagg_abort(e, q);
                }
            }
        if (ev->kind == PD_XFER_EV_CLOSED && ev->conn_id >= 0 && ev->conn_id < (int)PD_ARRAY_LEN(e->peers)) {
            struct peer_pool *pp = &e->peers[ev->conn_id];
            if (pp->base) pd_backend_unimport(e->backend, pp->base, &pp->handle);
            memset(pp, 0, sizeof *pp);
        }
        break;
    }
}
