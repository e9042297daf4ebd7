// kvconn.c — the connector core (see kvconn.h): turns session events (xfer) into connector
// events, keeps the prefill role's per-connection peer state, verifies loads, and runs saves
// through the transport of each peer (registry.c).
#include "kvconn/kvconn_impl.h"

#include <poll.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct peer_hello {  // PEER_UP's private part
    pd_kvw_hello hello;
    int fd;
} peer_hello;

void pd_kvconn_event_fini(pd_kvconn_event *ev) {
    pd_free(ev->owned);
    ev->owned = NULL;
    if (ev->tier_load) kvc_tier_load_free(ev->tier_load);  // never handled (pd_kvconn_tiers_loaded clears it)
    ev->tier_load = NULL;
    if (ev->priv) {
        peer_hello *ph = ev->priv;
        if (ph->fd >= 0) close(ph->fd);
        pd_free(ph);
        ev->priv = NULL;
    }
}

// On xfer I/O threads.
static void on_xfer_event(void *ud, pd_xfer_event *x) {
    pd_kvconn *c = ud;
    pd_kvconn_event *ev = pd_calloc(1, sizeof *ev);
    if (!ev) {
        PD_LOG_E("kvconn: out of memory for an event (request %llu)", (unsigned long long)x->req_id);
        return;
    }
    ev->peer = x->conn_id;
    ev->req_id = x->req_id;
    switch (x->kind) {
    case PD_XFER_EV_RESULT:
        ev->kind = PD_KVCONN_EV_LOAD_DONE;
        ev->status = x->status;
        memcpy(ev->reason, x->reason, sizeof ev->reason);
        ev->done = x->done;
        // two-sided transports: the posted receives complete (checked) or are cancelled first
        if (c->t && c->t->load_end) c->t->load_end(c, x->req_id, &ev->status, ev->reason, sizeof ev->reason);
        break;
    case PD_XFER_EV_HELLO: {
        ev->kind = PD_KVCONN_EV_PEER_UP;
        peer_hello *ph = pd_malloc(sizeof *ph);
        if (ph) {
            ph->hello = x->hello;
            ph->fd = x->fd;
            x->fd = -1;  // taken
        }
        ev->priv = ph;
        break;
    }
    case PD_XFER_EV_REQUEST:
        ev->kind = PD_KVCONN_EV_SAVE_REQUEST;
        ev->req = x->req;
        ev->owned = x->owned;
        x->owned = NULL;
        break;
    case PD_XFER_EV_CANCEL: ev->kind = PD_KVCONN_EV_CANCEL; break;
    case PD_XFER_EV_CLOSED: ev->kind = PD_KVCONN_EV_PEER_DOWN; break;
    }
    c->p.on_event(c->p.ud, ev);
}

size_t kvc_pool_bytes(const pd_kvconn *c, int n_blocks) {
    const pd_kvconn_cache *k = &c->p.cache;
    return 2 * (size_t)k->n_layers * (size_t)n_blocks * (size_t)k->block_size * k->row_bytes;
}

void kvc_debug_pause(pd_kvconn *c, const char *step) {
    if (!c->p.debug_pause || strcmp(c->p.debug_pause, step)) return;
    PD_LOG_W("kvconn: debug: paused at %s", step);
    fprintf(stderr, "pdserve: debug: paused at %s\n", step);
    for (;;) poll(NULL, 0, 1000);  // until killed (the fault tests kill -9 here)
}

pd_kvconn *pd_kvconn_new(const pd_kvconn_params *p, pd_err *err) {
    if (!p->on_event || !p->secret) {
        pd_err_set(err, PD_ERR_INVALID, "the KV connector needs a shared secret (--auth-token-file) and a callback");
        return NULL;
    }
    pd_kvconn *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->p = *p;
    if (c->p.timeout_ms <= 0) c->p.timeout_ms = 30000;
    const char *ov = getenv("PD_KV_OVERLAP");
    c->is_overlap_off = ov && !strcmp(ov, "0");
    if (p->role == PD_KVCONN_DECODE) {
        c->t = kvc_transport_find(p->transport);
        if (!c->t) {
            pd_err_set(err, PD_ERR_INVALID, "no KV transport %d", (int)p->transport);
            goto fail;
        }
        if (c->t->needs_host_pool && strcmp(pd_backend_name(p->backend), "cpu")) {
            pd_err_set(err, PD_ERR_UNSUPPORTED, "the %s KV transport needs a CPU KV pool; use cuda-ipc on GPUs", c->t->name);
            goto fail;
        }
        pd_xfer_client_params cp = {.n_workers = p->n_workers, .transport = p->transport, .fp = p->fp, .secret = p->secret,
                                    .backend = p->backend, .timeout_ms = p->timeout_ms, .on_event = on_xfer_event, .ud = c,
                                    .on_enqueue = p->on_enqueue, .enqueue_ud = p->enqueue_ud};
        for (int i = 0; i < p->n_workers && i < PD_XFER_MAX_WORKERS; i++) cp.addrs[i] = p->addrs[i];
        if (c->t->export_pool && c->t->export_pool(c, &cp.pool_handle, err)) goto fail;
        if (c->t->hello_blob && c->t->hello_blob(c, cp.hello_blob, &cp.hello_blob_len, err)) goto fail;
        cp.pool = (pd_xfer_pool){.n_layers = p->cache.n_layers, .n_blocks = p->cache.n_blocks,
                                 .block_size = p->cache.block_size, .row_bytes = p->cache.row_bytes, .k = p->cache.k,
                                 .v = p->cache.v};
        c->xc = pd_xfer_client_new(&cp, err);
        if (!c->xc) goto fail;
    } else {
        pd_xfer_server_params sp = {.host = p->host, .port = p->port, .fp = p->fp, .secret = p->secret, .backend = p->backend,
                                    .debug_pause = p->debug_pause, .on_event = on_xfer_event, .ud = c};
        c->xs = pd_xfer_server_new(&sp, err);
        if (!c->xs) goto fail;
    }
    c->p.secret = NULL;  // copied by the session layer; ours was borrowed for the call
    for (int i = 0; i < PD_KVCONN_MAX_WORKERS; i++) c->p.addrs[i] = NULL;
    return c;
fail:
    kvc_ucx.fini(c);
    kvc_nccl.fini(c);
    pd_free(c);
    return NULL;
}

void pd_kvconn_free(pd_kvconn *c) {
    if (!c) return;
    pd_xfer_client_free(c->xc);
    pd_xfer_server_free(c->xs);
    for (int i = 0; i < PD_XFER_MAX_CONNS; i++) {
        kvc_peer *pp = &c->peers[i];
        const kvc_transport *t = pp->conn_id ? kvc_transport_find(pp->transport) : NULL;
        if (t && t->detach) t->detach(c, pp);
    }
    kvc_ucx.fini(c);   // the transports with connector-wide state (both roles)
    kvc_nccl.fini(c);
    pd_free(c);
}

int pd_kvconn_port(const pd_kvconn *c) { return c->xs ? pd_xfer_server_port(c->xs) : 0; }
int pd_kvconn_n_healthy(pd_kvconn *c) { return c->xc ? pd_xfer_client_n_healthy(c->xc) : 0; }
const char *pd_kvconn_transport_name(const pd_kvconn *c) { return c->t ? c->t->name : "server"; }

void pd_kvconn_stats_get(pd_kvconn *c, pd_kvconn_stats *out) {
    pd_xfer_counters x = {0};
    if (c->xc) pd_xfer_client_counters(c->xc, &x);
    if (c->xs) pd_xfer_server_counters(c->xs, &x);
    *out = (pd_kvconn_stats){.auth_failures = x.auth_failures, .proto_errors = x.proto_errors,
                             .conns_accepted = x.conns_accepted, .conns_closed = x.conns_closed,
                             .slow_peer_drops = x.slow_peer_drops, .fenced = x.fenced,
                             .peers_refused = __atomic_load_n(&c->peers_refused, __ATOMIC_RELAXED),
                             .saves_layerwise = __atomic_load_n(&c->saves_layerwise, __ATOMIC_RELAXED),
                             .saves_failed = __atomic_load_n(&c->saves_failed, __ATOMIC_RELAXED)};
}

// ---- scheduler side ----------------------------------------------------------------------------
void pd_kvconn_match_tokens(pd_kvconn *c, int n_prompt, int n_local_hit, pd_kvconn_match *out) {
    int bs = c->p.cache.block_size;
    int start = n_local_hit > 0 ? n_local_hit / bs * bs : 0;
    out->n_tokens = c->xc && n_prompt > start ? n_prompt - start : 0;
    out->worker = c->xc && pd_xfer_client_n_healthy(c->xc) > 0 ? 0 : -1;
    // Predicted: the recent per-token load time (0 until a load was measured).
    int64_t ns_per_tok = __atomic_load_n(&c->ema_load_us, __ATOMIC_RELAXED);
    out->cost_us = (double)ns_per_tok / 1000.0 * out->n_tokens;
}

pd_status pd_kvconn_claim(pd_kvconn *c, uint64_t req_id, const char *worker_addr) {
    return c->xc ? pd_xfer_client_claim(c->xc, req_id, worker_addr) : PD_ERR_NOTFOUND;
}

int pd_kvconn_links(pd_kvconn *c, pd_link_stats *out, int max) {
    return c->xc ? pd_xfer_client_links(c->xc, out, max) : 0;
}

void pd_kvconn_set_step_model(pd_kvconn *c, double a_us, double b_us, int chunk_tokens) {
    if (c->xs) pd_xfer_server_set_step_model(c->xs, a_us, b_us, chunk_tokens);
}

double pd_kvconn_bytes_per_token(const pd_kvconn *c) {
    return 2.0 * c->p.cache.n_layers * (double)c->p.cache.row_bytes;
}

// ---- decode role -------------------------------------------------------------------------------
pd_status pd_kvconn_start_load(pd_kvconn *c, const pd_kvconn_load *l) {
    if (!c->xc) return PD_NOSPACE;
    pd_kvw_prefill_req r = {.req_id = l->req_id, .start_pos = l->start_pos, .n_tokens = l->n_tokens, .tokens = l->tokens,
                            .n_dst_blocks = l->n_dst_blocks, .dst_blocks = l->dst_blocks, .sampling = l->sampling};
    if (l->traceparent) snprintf(r.traceparent, sizeof r.traceparent, "%s", l->traceparent);
    if (c->t->load_post) {  // two-sided (ucx on device pools): the receives are posted before the request leaves
        pd_status st = c->t->load_post(c, l);
        if (st) return st == PD_ERR_INVALID ? st : PD_NOSPACE;
    }
    pd_status st = pd_xfer_client_prefill_on(c->xc, l->worker == PD_KVCONN_QUEUE ? PD_XFER_QUEUE : l->worker, &r);
    if (st == PD_NOSPACE && l->worker >= 0) st = pd_xfer_client_prefill_on(c->xc, -1, &r);  // the chosen one filled up
    if (st && c->t->load_end) {  // not sent: no RESULT will come, take the receives back now
        pd_status cs = st;
        char why[64];
        c->t->load_end(c, l->req_id, &cs, why, sizeof why);
    }
    return st;
}

bool pd_kvconn_load_verify(pd_kvconn *c, const pd_kvconn_event *ev, const int32_t *dst_blocks, int n_dst_blocks,
                           int start_pos, int n_tokens, int vocab, int64_t load_us, int64_t *bytes) {
    const pd_kvw_prefill_done *d = &ev->done;
    const pd_kvconn_cache *k = &c->p.cache;
    *bytes = 0;
    if (ev->status != PD_OK || d->n_layers != k->n_layers || d->first_token < 0 || d->first_token >= vocab ||
        n_dst_blocks <= 0)
        return false;
    int bs = k->block_size;
    int32_t *rows = pd_malloc(sizeof(int32_t) * (size_t)n_dst_blocks);
    uint64_t *sums = pd_malloc(sizeof(uint64_t) * (size_t)k->n_layers);
    bool ok = rows && sums;
    if (ok) {
        for (int i = 0; i < n_dst_blocks; i++) rows[i] = PD_MIN(bs, n_tokens - (start_pos + i * bs));
        pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = dst_blocks, .n_rows = rows, .n_blocks = n_dst_blocks,
                                    .layer_begin = 0, .layer_end = k->n_layers, .block_size = bs,
                                    .row_bytes = k->row_bytes, .sums = sums};
        pd_op_kv_checksum(c->p.backend, &cp);
        for (int l = 0; l < k->n_layers && ok; l++) ok = sums[l] == d->checksums[l];
        *bytes = (int64_t)(2 * (size_t)k->n_layers * k->row_bytes * (size_t)(n_tokens - start_pos));
    }
    pd_free(rows);
    pd_free(sums);
    if (ok && n_tokens > start_pos && load_us > 0) {  // EMA of ns per loaded token (engine thread writes)
        int64_t ns = load_us * 1000 / (n_tokens - start_pos), old = __atomic_load_n(&c->ema_load_us, __ATOMIC_RELAXED);
        __atomic_store_n(&c->ema_load_us, old ? (old * 4 + ns) / 5 : ns, __ATOMIC_RELAXED);
    }
    return ok;
}

pd_status pd_kvconn_wait_for_layer(pd_kvconn *c, uint64_t req_id, int layer) {
    if (!c->xc || layer < 0 || layer >= c->p.cache.n_layers) return PD_ERR_INVALID;
    int n = pd_xfer_client_layers_landed(c->xc, req_id);
    if (n < 0) return PD_ERR_INVALID;  // not in flight (never started, or its LOAD_DONE came)
    return c->t->is_layerwise && n > layer ? PD_OK : PD_AGAIN;
}

void pd_kvconn_request_finished(pd_kvconn *c, uint64_t req_id) {
    if (c->xc) pd_xfer_client_cancel(c->xc, req_id);
}

// ---- prefill role ------------------------------------------------------------------------------
kvc_peer *kvc_peer_of(pd_kvconn *c, int conn_id) {
    if (conn_id <= 0) return NULL;
    kvc_peer *p = &c->peers[PD_XFER_CONN_SLOT(conn_id)];
    return p->conn_id == conn_id ? p : NULL;
}

void pd_kvconn_peer_up(pd_kvconn *c, pd_kvconn_event *ev) {
    peer_hello *ph = ev->priv;
    if (!ph || ev->peer <= 0) return;
    kvc_peer *p = &c->peers[PD_XFER_CONN_SLOT(ev->peer)];
    const kvc_transport *old = p->conn_id ? kvc_transport_find(p->transport) : NULL;
    if (old && old->detach) old->detach(c, p);  // (PEER_DOWN of the slot's last user came first)
    memset(p, 0, sizeof *p);
    p->conn_id = ev->peer;
    p->transport = (pd_kvw_transport)ph->hello.transport;
    p->n_blocks = (int)PD_MIN(ph->hello.pool_n_blocks, (uint32_t)INT32_MAX);
    const kvc_transport *t = kvc_transport_find(p->transport);
    pd_err err = {0};
    int fd = ph->fd;
    ph->fd = -1;  // the transport takes it
    bool refuse = !t || c->p.debug_refuse_pools;
    if (refuse) {
        if (fd >= 0) close(fd);
        pd_err_set(&err, PD_ERR_PROTO, "%s", t ? "refused by the debug_refuse_pools test hook" : "unknown transport");
    }
    if (refuse || (t->attach && t->attach(c, p, &ph->hello, fd, &err))) {
        __atomic_add_fetch(&c->peers_refused, 1, __ATOMIC_RELAXED);
        snprintf(p->refused, sizeof p->refused, "decode pool refused: %.130s", err.msg[0] ? err.msg : "unknown");
        PD_LOG_W("kvconn: refusing decode worker %d's KV pool: %s", ev->peer, err.msg[0] ? err.msg : "unknown");
        return;
    }
    p->is_ready = true;
    PD_LOG_I("kvconn: decode worker %d connected (KV transport %s, pool of %d blocks)", ev->peer, t->name, p->n_blocks);
}

void pd_kvconn_peer_down(pd_kvconn *c, pd_kvconn_event *ev) {
    kvc_peer *p = kvc_peer_of(c, ev->peer);
    if (!p) return;
    const kvc_transport *t = kvc_transport_find(p->transport);
    if (t && t->detach) t->detach(c, p);
    memset(p, 0, sizeof *p);
}

const char *pd_kvconn_check_request(pd_kvconn *c, const pd_kvconn_event *ev, int vocab) {
    const pd_kvw_prefill_req *r = &ev->req;
    kvc_peer *p = kvc_peer_of(c, ev->peer);
    if (!p || !p->is_ready) return "decode pool not mapped";
    int bs = c->p.cache.block_size;
    int need = (r->n_tokens + bs - 1) / bs - r->start_pos / bs;
    if (r->start_pos % bs || r->n_dst_blocks != need) return "bad block list";
    for (int i = 0; i < r->n_dst_blocks; i++)
        if (r->dst_blocks[i] < 0 || r->dst_blocks[i] >= p->n_blocks) return "destination block out of range";
    for (int i = 0; i < r->n_tokens; i++)
        if (r->tokens[i] < 0 || r->tokens[i] >= vocab) return "token id out of range";
    return NULL;
}

void pd_kvconn_send_fail(pd_kvconn *c, int peer, uint64_t peer_req_id, const char *why) {
    if (!c->xs) return;
    __atomic_add_fetch(&c->saves_failed, 1, __ATOMIC_RELAXED);
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_FAIL};
    m.u.fail.req_id = peer_req_id;
    kvc_peer *p = kvc_peer_of(c, peer);
    if (p && p->refused[0]) {  // its pool was refused: the decode side counts that apart
        m.u.fail.code = PD_KVW_FAIL_POOL_REFUSED;
        why = p->refused;
    }
    snprintf(m.u.fail.reason, sizeof m.u.fail.reason, "%.200s", why);
    pd_xfer_server_send(c->xs, peer, &m, NULL);
}

pd_kvconn_save *pd_kvconn_save_begin(pd_kvconn *c, int peer, uint64_t peer_req_id, const int32_t *src_blocks,
                                     const int32_t *dst_blocks, int n_blocks, int start_pos, int n_tokens) {
    kvc_peer *p = kvc_peer_of(c, peer);
    pd_kvconn_save *s = pd_calloc(1, sizeof *s);
    if (!s) return NULL;
    size_t nb = (size_t)PD_MAX(n_blocks, 1);
    s->src = pd_malloc(sizeof(int32_t) * nb);
    s->dst = pd_malloc(sizeof(int32_t) * nb);
    s->rows = pd_malloc(sizeof(int32_t) * nb);
    s->sums = pd_calloc((size_t)c->p.cache.n_layers, sizeof(uint64_t));
    if (!s->src || !s->dst || !s->rows || !s->sums) {
        pd_kvconn_save_fail(c, s, NULL, false);
        return NULL;
    }
    int bs = c->p.cache.block_size;
    s->peer = p;
    s->t = p ? kvc_transport_find(p->transport) : NULL;
    s->conn_id = peer;
    s->peer_req_id = peer_req_id;
    s->n_blocks = n_blocks;
    s->start_pos = start_pos;
    s->n_tokens = n_tokens;
    memcpy(s->src, src_blocks, sizeof(int32_t) * (size_t)n_blocks);
    memcpy(s->dst, dst_blocks, sizeof(int32_t) * (size_t)n_blocks);
    for (int i = 0; i < n_blocks; i++) s->rows[i] = PD_MIN(bs, n_tokens - (start_pos + i * bs));
    s->is_corrupt = c->p.corrupt_every > 0 && ++c->n_saves % c->p.corrupt_every == 0;
    s->st = p && p->is_ready && n_blocks > 0 ? PD_OK : PD_ERR_CLOSED;
    return s;
}

static const kvc_transport *save_transport(pd_kvconn *c, pd_kvconn_save *s) {
    kvc_peer *p = kvc_peer_of(c, s->conn_id);
    return p && p == s->peer && p->is_ready ? kvc_transport_find(p->transport) : NULL;
}

void pd_kvconn_layer_begin(pd_kvconn *c, int layer) {
    (void)layer;
    c->is_mark_due = true;
}

static bool is_layerwise(const kvc_transport *t, pd_kvconn *c, pd_kvconn_save *s) {
    return t->layerwise ? t->layerwise(c, s) : t->is_layerwise;
}

void pd_kvconn_save_layer(pd_kvconn *c, pd_kvconn_save *s, int layer) {
    const kvc_transport *t = save_transport(c, s);
    if (!t || s->st || !is_layerwise(t, c, s) || c->is_overlap_off || layer != s->n_layers_saved) return;
    t->save_layer(c, s, layer);
    if (!s->st) s->n_layers_saved = layer + 1;
}

pd_status pd_kvconn_save_end(pd_kvconn *c, pd_kvconn_save *s, const pd_kvconn_first *first, int64_t *copy_us) {
    const kvc_transport *t = save_transport(c, s);
    int L = c->p.cache.n_layers;
    pd_status st = t ? s->st : PD_ERR_CLOSED;
    bool was_layerwise = s->n_layers_saved == L;
    if (st == PD_OK) st = t->save_rest(c, s);  // (ships what is left; direct: waits for the transfer stream)
    if (st == PD_OK && is_layerwise(t, c, s) && was_layerwise) __atomic_add_fetch(&c->saves_layerwise, 1, __ATOMIC_RELAXED);
    if (copy_us) *copy_us = s->copy_us;
    if (st) {
        pd_kvconn_save_fail(c, s, "KV export failed", true);
        return st;
    }
    kvc_debug_pause(c, "before_done");
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_DONE};
    pd_kvw_prefill_done *d = &m.u.done;
    d->req_id = s->peer_req_id;
    d->first_token = first->token;
    d->logprob = first->logprob;
    d->n_top = PD_MIN(first->n_top, PD_KVW_MAX_TOP);
    for (int i = 0; i < d->n_top; i++) d->top_ids[i] = first->top_ids[i], d->top_logprobs[i] = first->top_logprobs[i];
    d->n_layers = L;
    memcpy(d->checksums, s->sums, sizeof(uint64_t) * (size_t)L);
    d->n_tokens_computed = s->n_tokens;
    d->n_draws = first->n_draws;
    d->queue_us = first->queue_us;
    d->compute_us = first->compute_us;
    st = pd_xfer_server_send(c->xs, s->conn_id, &m, NULL);
    pd_kvconn_save_fail(c, s, NULL, false);  // frees
    return st;
}

void pd_kvconn_save_fail(pd_kvconn *c, pd_kvconn_save *s, const char *why, bool tell_peer) {
    if (!s) return;
    if (s->t && s->t->save_free) s->t->save_free(c, s);  // (nccl: its sends are done or aborted first)
    if (s->is_xfer_pending) pd_backend_xfer_sync(c->p.backend);  // nothing may still write s->sums
    if (why && tell_peer) pd_kvconn_send_fail(c, s->conn_id, s->peer_req_id, why);  // (counted there)
    else if (why) __atomic_add_fetch(&c->saves_failed, 1, __ATOMIC_RELAXED);
    pd_free(s->src);
    pd_free(s->dst);
    pd_free(s->rows);
    pd_free(s->sums);
    pd_free(s->dk);
    pd_free(s->dv);
    pd_free(s);
}

// ---- direct writes (shm, cuda-ipc) -------------------------------------------------------------
pd_status kvc_direct_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err) {
    if (!c->p.cache.buffer || pd_buffer_export(c->p.cache.buffer, h))
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "the KV pool cannot be exported for %s", c->t->name);
    return PD_OK;
}

// The peer's handle is checked against what is really behind it: the announced size must be
// exactly a pool of pool_n_blocks blocks of our geometry, and the importer refuses a handle whose
// object is smaller than announced (cpu: fstat of the memfd; cuda: the allocation's range).
pd_status kvc_direct_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, const char *kind, pd_err *err) {
    if (h->handle_len != sizeof p->handle) {
        if (fd >= 0) close(fd);
        return pd_err_set(err, PD_ERR_PROTO, "bad pool handle");
    }
    memcpy(&p->handle, h->handle, sizeof p->handle);
    p->handle.kind[sizeof p->handle.kind - 1] = 0;
    p->handle.fd = fd;
    pd_status st = PD_OK;
    if (strcmp(p->handle.kind, kind)) st = pd_err_set(err, PD_ERR_PROTO, "pool handle of kind '%s', %s expected", p->handle.kind, kind);
    else if (p->n_blocks <= 0 || p->handle.n_bytes != kvc_pool_bytes(c, p->n_blocks))
        st = pd_err_set(err, PD_ERR_PROTO, "pool of %d blocks announced in %llu bytes (%zu expected)", p->n_blocks,
                        (unsigned long long)p->handle.n_bytes, kvc_pool_bytes(c, p->n_blocks));
    if (st == PD_OK) {
        p->base = pd_backend_import(c->p.backend, &p->handle, err);
        if (!p->base) st = err ? err->status : PD_ERR_IO;
    }
    if (fd >= 0) close(fd);  // the mapping (if any) stays valid
    p->handle.fd = -1;
    return st;
}

void kvc_direct_detach(pd_kvconn *c, kvc_peer *p) {
    if (p->base) pd_backend_xfer_sync(c->p.backend);  // no copy may still target the mapping
    if (p->base) pd_backend_unimport(c->p.backend, p->base, &p->handle);
    p->base = NULL;
}

void kvc_direct_save_layer(pd_kvconn *c, pd_kvconn_save *s, int l) {
    const pd_kvconn_cache *k = &c->p.cache;
    kvc_peer *p = s->peer;
    int L = k->n_layers, bs = k->block_size;
    if (!s->dk) {
        size_t layer_stride = (size_t)p->n_blocks * k->row_bytes * (size_t)bs;
        s->dk = pd_malloc(sizeof(void *) * (size_t)L);
        s->dv = pd_malloc(sizeof(void *) * (size_t)L);
        if (!s->dk || !s->dv) {
            s->st = PD_ERR_NOMEM;
            return;
        }
        for (int i = 0; i < L; i++) {
            s->dk[i] = (char *)p->base + (size_t)(2 * i) * layer_stride;
            s->dv[i] = (char *)p->base + (size_t)(2 * i + 1) * layer_stride;
        }
    }
    if (c->is_mark_due) {  // after layer l's KV write on the compute stream (bounded run-ahead)
        pd_backend_xfer_mark(c->p.backend);
        c->is_mark_due = false;
    }
    int64_t t0 = pd_time_us();  // (after the mark: its wait is the compute's, not the copy's)
    // The fence: a writer whose connection ended stops here; the decode side waits out the layer
    // in progress (fence_ms) before it reuses the blocks. The mark above waited for layer l-1's
    // compute, so what is enqueued now runs within about one layer of this check.
    if (!pd_xfer_server_conn_alive(c->xs, s->conn_id)) {
        s->st = PD_ERR_CLOSED;
        return;
    }
    pd_kv_copy_params kp = {.src_k = k->k, .src_v = k->v, .dst_k = s->dk, .dst_v = s->dv, .src_blocks = s->src,
                            .dst_blocks = s->dst, .n_rows = s->rows, .n_blocks = s->n_blocks, .layer_begin = l,
                            .layer_end = l + 1, .block_size = bs, .row_bytes = k->row_bytes};
    pd_op_kv_copy_xfer(c->p.backend, &kp);
    pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = s->src, .n_rows = s->rows, .n_blocks = s->n_blocks,
                                .layer_begin = l, .layer_end = l + 1, .block_size = bs, .row_bytes = k->row_bytes,
                                .sums = s->sums + l};
    pd_op_kv_checksum_xfer(c->p.backend, &cp);  // same stream: after the copy, from the same source
    s->is_xfer_pending = true;
    s->copy_us += pd_time_us() - t0;
    if (l == L / 2) kvc_debug_pause(c, "mid_slab");
}

pd_status kvc_direct_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    const pd_kvconn_cache *k = &c->p.cache;
    int L = k->n_layers;
    if (s->n_layers_saved < L) c->is_mark_due = true;  // the forward pass is over: depend on all of it
    for (int l = s->n_layers_saved; l < L && !s->st; l++) {
        kvc_direct_save_layer(c, s, l);
        if (!s->st) s->n_layers_saved = l + 1;
    }
    int64_t t0 = pd_time_us();
    if (s->is_xfer_pending) pd_backend_xfer_sync(c->p.backend);  // the KV is in place, the sums filled
    s->is_xfer_pending = false;
    if (s->st == PD_OK && s->is_corrupt) {  // test hook: flip one bit of the copied V rows in the decode pool
        uint8_t x;
        char *at = (char *)s->dv[L - 1] + (size_t)s->dst[0] * k->row_bytes * (size_t)k->block_size;
        pd_backend_download(c->p.backend, &x, at, 1);
        x ^= 0x40;
        pd_backend_upload(c->p.backend, at, &x, 1);
        pd_backend_sync(c->p.backend);  // the KV must be in place before DONE leaves
    }
    s->copy_us += pd_time_us() - t0;
    return s->st;
}
