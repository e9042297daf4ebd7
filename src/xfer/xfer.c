// xfer.c — see xfer.h. Plain blocking sockets, one I/O thread per connection: the handoff carries
// few, large messages per request, so an event loop would buy nothing here.
#include "xfer/xfer.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void pd_xfer_event_fini(pd_xfer_event *ev) {
    pd_free(ev->owned);
    ev->owned = NULL;
}

// ---- framing -----------------------------------------------------------------------------------
static pd_status write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return PD_ERR_CLOSED;
        c += w;
        n -= (size_t)w;
    }
    return PD_OK;
}

static pd_status read_all(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = recv(fd, c, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return PD_ERR_TIMEOUT;
        if (r <= 0) return PD_ERR_CLOSED;
        c += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

// *fdp is read under mu: the connection's owner may close it (and set -1) concurrently.
static pd_status send_msg(const int *fdp, pthread_mutex_t *mu, const pd_kvw_msg *m, const void *payload) {
    pd_kvw_buf b = {0};
    pd_status st = pd_kvw_encode(&b, m);
    if (st == PD_OK) {
        pthread_mutex_lock(mu);
        int fd = *fdp;
        st = fd >= 0 ? write_all(fd, b.data, b.len) : PD_ERR_CLOSED;
        if (st == PD_OK && m->type == PD_KVW_KV_SLAB && m->u.kv_slab.payload_len)
            st = write_all(fd, payload, m->u.kv_slab.payload_len);
        pthread_mutex_unlock(mu);
    }
    pd_kvw_buf_fini(&b);
    return st;
}

// Reads one whole frame into *buf (grown as needed) and decodes it. m borrows *buf.
static pd_status recv_msg(int fd, uint8_t **buf, size_t *cap, pd_kvw_msg *m, pd_err *err) {
    if (*cap < PD_KVW_HDR) {
        uint8_t *nb = pd_realloc(*buf, 4096);
        if (!nb) return PD_ERR_NOMEM;
        *buf = nb;
        *cap = 4096;
    }
    pd_status st = read_all(fd, *buf, PD_KVW_HDR);
    if (st) return st;
    uint64_t total = pd_kvw_peek_len(*buf);
    if (!total) return pd_err_set(err, PD_ERR_PROTO, "bad frame header");
    if (total > *cap) {
        uint8_t *nb = pd_realloc(*buf, (size_t)total);
        if (!nb) return PD_ERR_NOMEM;
        *buf = nb;
        *cap = (size_t)total;
    }
    st = read_all(fd, *buf + PD_KVW_HDR, (size_t)total - PD_KVW_HDR);
    if (st) return st;
    size_t used;
    return pd_kvw_decode(*buf, (size_t)total, m, &used, err);
}

static int dial(const char *addr, int timeout_ms) {
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || (size_t)(colon - addr) >= sizeof host) return -1;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &res) || !res) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) < 0) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

// ---- decode side -------------------------------------------------------------------------------
#define NCCL_JOIN_MS 20000  // both sides' bound on joining a new communicator

typedef struct inflight {
    uint64_t req_id;
    int64_t deadline_us;
    bool timed_out;          // cancelled at its deadline; blocks stay reserved until the answer
    int64_t grace_end_us;    // timed out: drop the connection if no answer by then
    int32_t start_pos, n_tokens;
    int32_t *dst_blocks;  // owned (tcp: where slabs land)
    int32_t n_dst_blocks;
} inflight;

typedef struct worker {
    pd_xfer_client *c;  // borrowed back-pointer
    int idx;
    char addr[256];
    pthread_t thread;
    pthread_mutex_t mu;      // guards fd writes, inflight, healthy
    int fd;
    bool healthy;
    inflight *inf;
    int n_inf, cap_inf;
    // nccl transport (I/O thread only)
    pd_comm *comm;       // this connection's communicator (rank 0)
    pd_buffer *staging;  // receive slab, grown as needed
} worker;

struct pd_xfer_client {
    pd_xfer_client_params p;
    worker workers[PD_XFER_MAX_WORKERS];
    volatile bool stop;
};

static void emit_result(pd_xfer_client *c, int widx, uint64_t id, pd_status st, const char *reason, const pd_kvw_prefill_done *d) {
    pd_xfer_event ev = {.kind = PD_XFER_EV_RESULT, .conn_id = widx, .req_id = id, .status = st};
    if (reason) snprintf(ev.reason, sizeof ev.reason, "%s", reason);
    if (d) ev.done = *d;
    c->p.on_event(c->p.ud, &ev);
}

// Removes an in-flight entry (caller holds w->mu). Returns false if absent.
static bool take_inflight(worker *w, uint64_t id, inflight *out) {
    for (int i = 0; i < w->n_inf; i++)
        if (w->inf[i].req_id == id) {
            if (out) *out = w->inf[i];
            else pd_free(w->inf[i].dst_blocks);
            w->inf[i] = w->inf[--w->n_inf];
            return true;
        }
    return false;
}

static void fail_all(worker *w, pd_status st, const char *reason) {
    pthread_mutex_lock(&w->mu);
    inflight *inf = w->inf;
    int n = w->n_inf;
    w->inf = NULL;
    w->n_inf = w->cap_inf = 0;
    w->healthy = false;
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < n; i++) {
        if (inf[i].timed_out) emit_result(w->c, w->idx, inf[i].req_id, PD_ERR_TIMEOUT, "prefill timed out", NULL);
        else emit_result(w->c, w->idx, inf[i].req_id, st, reason, NULL);
        pd_free(inf[i].dst_blocks);
    }
    pd_free(inf);
}

// tcp transport: writes one layer's K rows then V rows into the reserved blocks.
static pd_status land_slab(worker *w, const pd_kvw_kv_slab *s) {
    const pd_xfer_pool *pool = &w->c->p.pool;
    pthread_mutex_lock(&w->mu);
    inflight *f = NULL;
    for (int i = 0; i < w->n_inf; i++)
        if (w->inf[i].req_id == s->req_id) f = &w->inf[i];
    pd_status st = PD_OK;
    if (!f || f->timed_out) goto out;  // cancelled or timed out: its blocks are not ours to write
    size_t rows = (size_t)(s->n_blocks - 1) * (size_t)pool->block_size + (size_t)s->n_rows_last;
    if (s->layer >= pool->n_layers || s->n_blocks != f->n_dst_blocks || s->row_bytes != pool->row_bytes ||
        s->n_rows_last > pool->block_size || s->payload_len != 2 * rows * pool->row_bytes) {
        st = PD_ERR_PROTO;
        goto out;
    }
    const uint8_t *src = s->payload;
    size_t bb = pool->row_bytes * (size_t)pool->block_size;
    for (int kv = 0; kv < 2; kv++) {
        char *base = kv ? pool->v[s->layer] : pool->k[s->layer];
        for (int i = 0; i < s->n_blocks; i++) {
            int32_t b = f->dst_blocks[i];
            size_t n = pool->row_bytes * (size_t)(i == s->n_blocks - 1 ? s->n_rows_last : pool->block_size);
            if (b < 0 || b >= pool->n_blocks) {
                st = PD_ERR_PROTO;
                goto out;
            }
            memcpy(base + (size_t)b * bb, src, n);
            src += n;
        }
    }
out:
    pthread_mutex_unlock(&w->mu);
    return st;
}

// nccl transport: receives the announced slab (always: the communicator's order must stay in step
// with the sender) and scatters it into the request's blocks if they are still reserved for it.
// Returns NULL, or why the connection must be dropped.
static const char *land_nccl(worker *w, const pd_kvw_kv_nccl *s) {
    pd_xfer_client *c = w->c;
    const pd_xfer_pool *pool = &c->p.pool;
    if (!w->comm) return "KV_NCCL on a connection without a communicator";
    pd_err err = {0};
    if (!pd_buffer_reserve(c->p.backend, &w->staging, (size_t)s->bytes)) return "out of device memory for an nccl slab";
    char *stg = pd_buffer_ptr(w->staging);
    if (pd_comm_recv(w->comm, stg, (size_t)s->bytes, 1, &err) || pd_comm_wait(w->comm, c->p.timeout_ms, &err)) {
        PD_LOG_W("xfer: %s", err.msg);
        return "nccl transfer failed";
    }
    int nb = s->n_blocks, L = s->n_layers, bs = s->block_size;
    int32_t *idx = pd_malloc(sizeof(int32_t) * 3 * (size_t)nb);  // src blocks, dst blocks, rows
    void **ptrs = pd_malloc(sizeof(void *) * 2 * (size_t)L);
    if (!idx || !ptrs) {
        pd_free(idx);
        pd_free(ptrs);
        return "out of memory";
    }
    bool found = false, geom_ok = false;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_inf && !found; i++) {
        inflight *f = &w->inf[i];
        if (f->req_id != s->req_id || f->timed_out) continue;
        found = true;
        geom_ok = nb == f->n_dst_blocks && L == pool->n_layers && bs == pool->block_size && s->row_bytes == pool->row_bytes;
        for (int b = 0; b < nb && geom_ok; b++) {
            geom_ok = f->dst_blocks[b] >= 0 && f->dst_blocks[b] < pool->n_blocks;
            idx[b] = b, idx[nb + b] = f->dst_blocks[b], idx[2 * nb + b] = b == nb - 1 ? s->n_rows_last : bs;
        }
    }
    pthread_mutex_unlock(&w->mu);
    const char *why = NULL;
    if (found && !geom_ok) {
        inflight f;
        pthread_mutex_lock(&w->mu);
        bool had = take_inflight(w, s->req_id, &f);
        pthread_mutex_unlock(&w->mu);
        if (had) {
            emit_result(c, w->idx, f.req_id, PD_ERR_PROTO, "KV_NCCL slab does not match the request", NULL);
            pd_free(f.dst_blocks);
        }
    } else if (found) {
        // Only this thread removes entries once the request was sent, so the blocks stay ours.
        pd_kvw_kv_nccl_layers(s, stg, ptrs, ptrs + L);
        pd_kv_copy_params kp = {.src_k = ptrs, .src_v = ptrs + L, .dst_k = pool->k, .dst_v = pool->v, .src_blocks = idx,
                                .dst_blocks = idx + nb, .n_rows = idx + 2 * nb, .n_blocks = nb, .layer_begin = 0,
                                .layer_end = L, .block_size = bs, .row_bytes = (size_t)s->row_bytes};
        pd_comm_kv_copy(w->comm, &kp);
        if (pd_comm_wait(w->comm, c->p.timeout_ms, &err)) {
            PD_LOG_W("xfer: %s", err.msg);
            why = "nccl scatter failed";
        }
    }
    pd_free(idx);
    pd_free(ptrs);
    return why;
}

// Returns NULL, or why the connection must be dropped.
static const char *handle_client_msg(worker *w, const pd_kvw_msg *m, int64_t *last_pong) {
    inflight f;
    switch (m->type) {
    case PD_KVW_PONG: *last_pong = pd_time_us(); break;
    case PD_KVW_KV_SLAB:
        if (land_slab(w, &m->u.kv_slab)) {
            pthread_mutex_lock(&w->mu);
            bool had = take_inflight(w, m->u.kv_slab.req_id, &f);
            pthread_mutex_unlock(&w->mu);
            if (had) {
                emit_result(w->c, w->idx, f.req_id, PD_ERR_PROTO, "malformed KV slab", NULL);
                pd_free(f.dst_blocks);
            }
        }
        break;
    case PD_KVW_PREFILL_DONE:
    case PD_KVW_PREFILL_FAIL: {
        uint64_t id = m->type == PD_KVW_PREFILL_DONE ? m->u.done.req_id : m->u.fail.req_id;
        pthread_mutex_lock(&w->mu);
        bool had = take_inflight(w, id, &f);
        pthread_mutex_unlock(&w->mu);
        if (!had) break;  // a late duplicate
        pd_free(f.dst_blocks);
        // A timed-out request ends here: the worker is done with its blocks, the engine may reuse them.
        if (f.timed_out) emit_result(w->c, w->idx, id, PD_ERR_TIMEOUT, "prefill timed out", NULL);
        else if (m->type == PD_KVW_PREFILL_DONE) emit_result(w->c, w->idx, id, PD_OK, NULL, &m->u.done);
        else emit_result(w->c, w->idx, id, PD_ERR_INVALID, m->u.fail.reason, NULL);
        break;
    }
    case PD_KVW_KV_NCCL: return land_nccl(w, &m->u.kv_nccl);
    default: break;
    }
    return NULL;
}

static bool handshake(worker *w, int fd) {
    pd_xfer_client *c = w->c;
    pd_kvw_msg m = {.type = PD_KVW_HELLO};
    m.u.hello.fp = c->p.fp;
    m.u.hello.transport = (uint32_t)c->p.transport;
    m.u.hello.pool_n_blocks = (uint32_t)c->p.pool.n_blocks;
    pd_comm_id cid;
    pd_err cerr = {0};
    if (c->p.transport == PD_KVW_TRANSPORT_NCCL) {
        if (pd_comm_id_new(c->p.backend, &cid, &cerr)) {
            PD_LOG_W("xfer: %s", cerr.msg);
            return false;
        }
        m.u.hello.handle_len = sizeof cid;
        memcpy(m.u.hello.handle, &cid, sizeof cid);
    } else if (c->p.transport != PD_KVW_TRANSPORT_TCP) {
        m.u.hello.handle_len = sizeof c->p.pool_handle;
        memcpy(m.u.hello.handle, &c->p.pool_handle, sizeof c->p.pool_handle);
    }
    pthread_mutex_t tmp = PTHREAD_MUTEX_INITIALIZER;
    if (send_msg(&fd, &tmp, &m, NULL)) return false;
    uint8_t *buf = NULL;
    size_t cap = 0;
    pd_kvw_msg ack;
    pd_err err = {0};
    bool ok = recv_msg(fd, &buf, &cap, &ack, &err) == PD_OK && ack.type == PD_KVW_HELLO_ACK;
    if (ok && !ack.u.hello_ack.ok) {
        PD_LOG_W("xfer: prefill worker %s refused us: %s", w->addr, ack.u.hello_ack.error);
        ok = false;
    }
    if (ok) pd_kvw_msg_fini(&ack);
    pd_free(buf);
    if (ok && c->p.transport == PD_KVW_TRANSPORT_NCCL) {
        // The prefill worker joins right after its HELLO_ACK; both sides wait at most this long.
        w->comm = pd_comm_new(c->p.backend, &cid, 2, 0, NCCL_JOIN_MS, &cerr);
        if (!w->comm) PD_LOG_W("xfer: nccl bootstrap with %s failed: %s", w->addr, cerr.msg);
        ok = w->comm != NULL;
    }
    return ok;
}

// Per-request deadlines: a request past its deadline is cancelled but stays registered (the
// engine's blocks stay reserved) until the worker answers. Returns true when a cancelled request
// stayed unanswered past the grace period (the connection is then dropped).
static bool check_deadlines(worker *w, int64_t now) {
    pd_xfer_client *c = w->c;
    bool unanswered = false;
    for (;;) {
        uint64_t id = 0;
        bool expired = false;
        pthread_mutex_lock(&w->mu);
        for (int i = 0; i < w->n_inf && !expired; i++) {
            inflight *f = &w->inf[i];
            if (f->timed_out) {
                unanswered |= f->grace_end_us < now;
            } else if (f->deadline_us < now) {
                f->timed_out = expired = true;
                f->grace_end_us = now + (int64_t)c->p.cancel_grace_ms * 1000;
                id = f->req_id;
            }
        }
        pthread_mutex_unlock(&w->mu);
        if (!expired) return unanswered;
        PD_LOG_W("xfer: request %llu timed out on %s: cancelled, its blocks stay reserved until the worker answers",
                 (unsigned long long)id, w->addr);
        pd_kvw_msg cm = {.type = PD_KVW_CANCEL};
        cm.u.cancel.req_id = id;
        send_msg(&w->fd, &w->mu, &cm, NULL);
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    pd_xfer_client *c = w->c;
    uint8_t *buf = NULL;
    size_t cap = 0;
    int backoff_ms = 50;
    while (!c->stop) {
        int fd = dial(w->addr, c->p.ping_ms * 4);
        if (fd < 0 || !handshake(w, fd)) {
            if (fd >= 0) close(fd);
            for (int i = 0; i < backoff_ms / 10 && !c->stop; i++) poll(NULL, 0, 10);
            backoff_ms = PD_MIN(backoff_ms * 2, 1000);
            continue;
        }
        backoff_ms = 50;
        pthread_mutex_lock(&w->mu);
        w->fd = fd;
        w->healthy = true;
        pthread_mutex_unlock(&w->mu);
        PD_LOG_I("xfer: connected to prefill worker %s (%s)", w->addr, pd_kvw_transport_name(c->p.transport));
        int64_t last_ping = pd_time_us(), last_pong = last_ping;
        const char *why = "prefill worker connection lost";
        pd_status why_st = PD_ERR_CLOSED;
        while (!c->stop) {
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            int r = poll(&pfd, 1, 50);
            if (r > 0) {
                pd_kvw_msg m;
                pd_err err = {0};
                pd_status st = recv_msg(fd, &buf, &cap, &m, &err);
                if (st) {
                    if (st == PD_ERR_PROTO) why = "protocol error from prefill worker", why_st = PD_ERR_PROTO;
                    break;
                }
                const char *drop = handle_client_msg(w, &m, &last_pong);
                pd_kvw_msg_fini(&m);
                if (drop) {
                    why = drop, why_st = PD_ERR_CLOSED;
                    break;
                }
            }
            int64_t now = pd_time_us();
            if (now - last_ping >= (int64_t)c->p.ping_ms * 1000) {
                pd_kvw_msg ping = {.type = PD_KVW_PING};
                ping.u.ping.nonce = (uint64_t)now;
                if (send_msg(&w->fd, &w->mu, &ping, NULL)) break;
                last_ping = now;
            }
            if (now - last_pong > (int64_t)c->p.ping_ms * 4000) {
                why = "prefill worker stopped answering heartbeats";
                why_st = PD_ERR_TIMEOUT;
                break;
            }
            bool unanswered = check_deadlines(w, now);
            if (unanswered) {
                why = "prefill worker did not answer a cancelled request";
                why_st = PD_ERR_TIMEOUT;
                break;
            }
        }
        pthread_mutex_lock(&w->mu);
        w->fd = -1;
        pthread_mutex_unlock(&w->mu);
        close(fd);
        pd_comm_free(w->comm);  // aborts anything in flight: nothing lands after this
        w->comm = NULL;
        if (!c->stop) PD_LOG_W("xfer: %s (%s); in-flight requests fall back", why, w->addr);
        fail_all(w, why_st, why);
    }
    pd_free(buf);
    return NULL;
}

pd_xfer_client *pd_xfer_client_new(const pd_xfer_client_params *p, pd_err *err) {
    if (p->n_workers <= 0 || p->n_workers > PD_XFER_MAX_WORKERS || !p->on_event) {
        pd_err_set(err, PD_ERR_INVALID, "xfer client: 1..%d prefill workers and a callback are needed", PD_XFER_MAX_WORKERS);
        return NULL;
    }
    pd_xfer_client *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->p = *p;
    if (c->p.timeout_ms <= 0) c->p.timeout_ms = 30000;
    if (c->p.ping_ms <= 0) c->p.ping_ms = 500;
    if (c->p.max_inflight <= 0) c->p.max_inflight = 64;
    if (c->p.cancel_grace_ms <= 0) c->p.cancel_grace_ms = 10000;
    if (p->transport == PD_KVW_TRANSPORT_NCCL && !p->backend) {
        pd_free(c);
        pd_err_set(err, PD_ERR_INVALID, "xfer client: the nccl transport needs the decode pool's backend");
        return NULL;
    }
    for (int i = 0; i < p->n_workers; i++) {
        worker *w = &c->workers[i];
        w->c = c;
        w->idx = i;
        w->fd = -1;
        snprintf(w->addr, sizeof w->addr, "%s", p->addrs[i]);
        c->p.addrs[i] = w->addr;
        pthread_mutex_init(&w->mu, NULL);
        if (pthread_create(&w->thread, NULL, worker_main, w)) {
            c->p.n_workers = i;
            pd_xfer_client_free(c);
            pd_err_set(err, PD_ERR_IO, "cannot start an xfer thread");
            return NULL;
        }
    }
    return c;
}

void pd_xfer_client_free(pd_xfer_client *c) {
    if (!c) return;
    c->stop = true;
    for (int i = 0; i < c->p.n_workers; i++) {
        worker *w = &c->workers[i];
        pthread_join(w->thread, NULL);
        for (int k = 0; k < w->n_inf; k++) pd_free(w->inf[k].dst_blocks);
        pd_free(w->inf);
        pd_buffer_free(w->staging);
        pthread_mutex_destroy(&w->mu);
    }
    pd_free(c);
}

int pd_xfer_client_n_healthy(pd_xfer_client *c) {
    int n = 0;
    for (int i = 0; i < c->p.n_workers; i++) {
        pthread_mutex_lock(&c->workers[i].mu);
        n += c->workers[i].healthy;
        pthread_mutex_unlock(&c->workers[i].mu);
    }
    return n;
}

pd_status pd_xfer_client_prefill(pd_xfer_client *c, const pd_kvw_prefill_req *req) {
    // Least in-flight healthy worker; a worker at max_inflight is saturated.
    worker *best = NULL;
    int best_n = 1 << 30;
    for (int i = 0; i < c->p.n_workers; i++) {
        worker *w = &c->workers[i];
        pthread_mutex_lock(&w->mu);
        if (w->healthy && w->n_inf < c->p.max_inflight && w->n_inf < best_n) {
            best = w;
            best_n = w->n_inf;
        }
        pthread_mutex_unlock(&w->mu);
    }
    if (!best) return PD_NOSPACE;
    inflight f = {.req_id = req->req_id, .deadline_us = pd_time_us() + (int64_t)c->p.timeout_ms * 1000,
                  .start_pos = req->start_pos, .n_tokens = req->n_tokens, .n_dst_blocks = req->n_dst_blocks};
    f.dst_blocks = pd_malloc(sizeof(int32_t) * (size_t)(req->n_dst_blocks + 1));
    if (!f.dst_blocks) return PD_ERR_NOMEM;
    memcpy(f.dst_blocks, req->dst_blocks, sizeof(int32_t) * (size_t)req->n_dst_blocks);
    pthread_mutex_lock(&best->mu);
    if (best->n_inf == best->cap_inf) {
        int nc = best->cap_inf ? best->cap_inf * 2 : 16;
        inflight *ni = pd_realloc(best->inf, sizeof *ni * (size_t)nc);
        if (!ni) {
            pthread_mutex_unlock(&best->mu);
            pd_free(f.dst_blocks);
            return PD_ERR_NOMEM;
        }
        best->inf = ni;
        best->cap_inf = nc;
    }
    best->inf[best->n_inf++] = f;  // registered before sending: the reply may race the send
    int fd = best->fd;
    pthread_mutex_unlock(&best->mu);
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_REQ};
    m.u.prefill_req = *req;
    pd_kvw_buf b = {0};
    pd_status st = pd_kvw_encode(&b, &m);
    bool retracted = false;
    pthread_mutex_lock(&best->mu);
    if (st == PD_OK) st = best->fd == fd && fd >= 0 ? write_all(fd, b.data, b.len) : PD_ERR_CLOSED;
    if (st) retracted = take_inflight(best, req->req_id, NULL);
    pthread_mutex_unlock(&best->mu);
    pd_kvw_buf_fini(&b);
    // A failed send whose entry we took back means "no worker now": the caller prefills locally.
    // If the I/O thread already failed the entry (connection lost), it emitted the one RESULT.
    return st == PD_OK || !retracted ? PD_OK : PD_NOSPACE;
}

void pd_xfer_client_cancel(pd_xfer_client *c, uint64_t req_id) {
    for (int i = 0; i < c->p.n_workers; i++) {
        worker *w = &c->workers[i];
        pthread_mutex_lock(&w->mu);
        bool had = false;  // (a timed-out request was cancelled already)
        for (int k = 0; k < w->n_inf && !had; k++) had = w->inf[k].req_id == req_id && !w->inf[k].timed_out;
        pthread_mutex_unlock(&w->mu);
        if (had) {
            pd_kvw_msg cm = {.type = PD_KVW_CANCEL};
            cm.u.cancel.req_id = req_id;
            send_msg(&w->fd, &w->mu, &cm, NULL);
        }
    }
}

// ---- prefill side ------------------------------------------------------------------------------
#define MAX_CONNS 256

typedef struct sconn {
    pd_xfer_server *s;  // borrowed
    int id, fd;
    pthread_t thread;
    pthread_mutex_t mu;  // guards writes
    bool done;
    // nccl transport
    pthread_mutex_t kv_mu;  // guards comm and staging; held for a whole slab send
    pd_comm *comm;          // rank 1 of this connection's communicator
    pd_buffer *staging;     // the slab being sent (device), grown as needed
} sconn;

struct pd_xfer_server {
    pd_xfer_server_params p;
    int lfd, port;
    pthread_t accept_thread;
    pthread_mutex_t mu;  // guards conns / n_conns
    sconn *conns[MAX_CONNS];
    int n_conns;
    volatile bool stop;
};

static void *sconn_main(void *arg) {
    sconn *k = arg;
    pd_xfer_server *s = k->s;
    uint8_t *buf = NULL;
    size_t cap = 0;
    pd_kvw_msg m;
    pd_err err = {0};
    bool hello_ok = false, announced = false, nccl = false;
    pd_comm_id cid;
    if (recv_msg(k->fd, &buf, &cap, &m, &err) == PD_OK && m.type == PD_KVW_HELLO) {
        pd_kvw_msg ack = {.type = PD_KVW_HELLO_ACK};
        ack.u.hello_ack.fp = s->p.fp;
        const char *diff = pd_kvw_fingerprint_diff(&m.u.hello.fp, &s->p.fp);
        nccl = m.u.hello.transport == PD_KVW_TRANSPORT_NCCL;
        if (nccl && m.u.hello.handle_len == sizeof cid) memcpy(&cid, m.u.hello.handle, sizeof cid);
        if (*diff) {
            snprintf(ack.u.hello_ack.error, sizeof ack.u.hello_ack.error, "model fingerprint mismatch: %s", diff);
            PD_LOG_W("xfer: refusing a decode worker: %s", ack.u.hello_ack.error);
        } else if (nccl && (!s->p.backend || m.u.hello.handle_len != sizeof cid)) {
            snprintf(ack.u.hello_ack.error, sizeof ack.u.hello_ack.error, "%s",
                     s->p.backend ? "nccl: bad unique id" : "this prefill worker cannot use the nccl transport");
            PD_LOG_W("xfer: refusing a decode worker: %s", ack.u.hello_ack.error);
        } else {
            // The engine maps the decode pool (if any) before any request can arrive.
            pd_xfer_event ev = {.kind = PD_XFER_EV_HELLO, .conn_id = k->id, .hello = m.u.hello};
            s->p.on_event(s->p.ud, &ev);
            ack.u.hello_ack.ok = 1;
            hello_ok = announced = true;
        }
        pd_kvw_msg_fini(&m);
        if (send_msg(&k->fd, &k->mu, &ack, NULL)) hello_ok = false;
    }
    if (hello_ok && nccl) {  // the decode worker joins as rank 0 after our HELLO_ACK
        pd_comm *cm = pd_comm_new(s->p.backend, &cid, 2, 1, NCCL_JOIN_MS, &err);
        if (!cm) PD_LOG_W("xfer: nccl bootstrap with decode worker %d failed: %s", k->id, err.msg);
        pthread_mutex_lock(&k->kv_mu);
        k->comm = cm;
        pthread_mutex_unlock(&k->kv_mu);
        hello_ok = cm != NULL;
    }
    while (hello_ok && !s->stop) {
        struct pollfd pfd = {.fd = k->fd, .events = POLLIN};
        int r = poll(&pfd, 1, 100);
        if (r <= 0) continue;
        pd_status st = recv_msg(k->fd, &buf, &cap, &m, &err);
        if (st == PD_ERR_TIMEOUT) continue;
        if (st) break;
        if (m.type == PD_KVW_PING) {
            pd_kvw_msg pong = {.type = PD_KVW_PONG};
            pong.u.ping.nonce = m.u.ping.nonce;
            send_msg(&k->fd, &k->mu, &pong, NULL);
        } else if (m.type == PD_KVW_PREFILL_REQ) {
            pd_xfer_event ev = {.kind = PD_XFER_EV_REQUEST, .conn_id = k->id, .req_id = m.u.prefill_req.req_id,
                                .req = m.u.prefill_req};
            ev.owned = m.owned_i32;  // tokens + dst blocks move into the event
            m.owned_i32 = NULL;
            s->p.on_event(s->p.ud, &ev);
            pd_xfer_event_fini(&ev);
        } else if (m.type == PD_KVW_CANCEL) {
            pd_xfer_event ev = {.kind = PD_XFER_EV_CANCEL, .conn_id = k->id, .req_id = m.u.cancel.req_id};
            s->p.on_event(s->p.ud, &ev);
        }
        pd_kvw_msg_fini(&m);
    }
    pd_free(buf);
    pthread_mutex_lock(&k->kv_mu);  // waits for a slab send in progress (bounded by its timeout)
    pd_comm_free(k->comm);
    k->comm = NULL;
    pd_buffer_free(k->staging);
    k->staging = NULL;
    pthread_mutex_unlock(&k->kv_mu);
    pthread_mutex_lock(&k->mu);
    close(k->fd);
    k->fd = -1;
    k->done = true;
    pthread_mutex_unlock(&k->mu);
    if (announced) {
        pd_xfer_event ev = {.kind = PD_XFER_EV_CLOSED, .conn_id = k->id};
        s->p.on_event(s->p.ud, &ev);
    }
    return NULL;
}

static void *accept_main(void *arg) {
    pd_xfer_server *s = arg;
    while (!s->stop) {
        struct pollfd pfd = {.fd = s->lfd, .events = POLLIN};
        if (poll(&pfd, 1, 100) <= 0) continue;
        int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct timeval tv = {.tv_sec = 10};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);  // a frame that stalls mid-way
        pthread_mutex_lock(&s->mu);
        sconn *k = s->n_conns < MAX_CONNS ? pd_calloc(1, sizeof *k) : NULL;
        if (!k) {
            pthread_mutex_unlock(&s->mu);
            close(fd);
            continue;
        }
        k->s = s;
        k->fd = fd;
        k->id = s->n_conns;
        pthread_mutex_init(&k->mu, NULL);
        pthread_mutex_init(&k->kv_mu, NULL);
        s->conns[s->n_conns++] = k;
        if (pthread_create(&k->thread, NULL, sconn_main, k)) {
            s->conns[--s->n_conns] = NULL;
            close(fd);
            pthread_mutex_destroy(&k->mu);
            pthread_mutex_destroy(&k->kv_mu);
            pd_free(k);
        }
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

pd_xfer_server *pd_xfer_server_new(const pd_xfer_server_params *p, pd_err *err) {
    pd_xfer_server *s = pd_calloc(1, sizeof *s);
    if (!s) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->p = *p;
    pthread_mutex_init(&s->mu, NULL);
    const char *host = p->host && *p->host ? p->host : "127.0.0.1";
    char port[16];
    snprintf(port, sizeof port, "%d", p->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) || !res) {
        pd_err_set(err, PD_ERR_INVALID, "xfer: cannot resolve %s", host);
        goto fail;
    }
    s->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (s->lfd < 0 || bind(s->lfd, res->ai_addr, res->ai_addrlen) || listen(s->lfd, 64)) {
        pd_err_set(err, PD_ERR_IO, "xfer: cannot listen on %s:%d: %s", host, p->port, strerror(errno));
        freeaddrinfo(res);
        goto fail;
    }
    freeaddrinfo(res);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(s->lfd, (struct sockaddr *)&ss, &sl);
    s->port = ntohs(ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port : ((struct sockaddr_in6 *)&ss)->sin6_port);
    if (pthread_create(&s->accept_thread, NULL, accept_main, s)) {
        pd_err_set(err, PD_ERR_IO, "xfer: cannot start the accept thread");
        goto fail;
    }
    return s;
fail:
    if (s->lfd > 0) close(s->lfd);
    pthread_mutex_destroy(&s->mu);
    pd_free(s);
    return NULL;
}

int pd_xfer_server_port(const pd_xfer_server *s) { return s->port; }

void pd_xfer_server_free(pd_xfer_server *s) {
    if (!s) return;
    s->stop = true;
    pthread_join(s->accept_thread, NULL);
    for (int i = 0; i < s->n_conns; i++) {
        sconn *k = s->conns[i];
        pthread_mutex_lock(&k->mu);
        if (k->fd >= 0) shutdown(k->fd, SHUT_RDWR);
        pthread_mutex_unlock(&k->mu);
        pthread_join(k->thread, NULL);
        pthread_mutex_destroy(&k->mu);
        pthread_mutex_destroy(&k->kv_mu);
        pd_free(k);
    }
    close(s->lfd);
    pthread_mutex_destroy(&s->mu);
    pd_free(s);
}

pd_status pd_xfer_server_send(pd_xfer_server *s, int conn_id, const pd_kvw_msg *m, const void *payload) {
    pthread_mutex_lock(&s->mu);
    sconn *k = conn_id >= 0 && conn_id < s->n_conns ? s->conns[conn_id] : NULL;
    pthread_mutex_unlock(&s->mu);
    if (!k) return PD_ERR_CLOSED;
    return send_msg(&k->fd, &k->mu, m, payload);
}

pd_status pd_xfer_server_send_nccl(pd_xfer_server *s, int conn_id, const pd_kvw_kv_nccl *slab, pd_xfer_fill_fn fill,
                                   void *ud, int timeout_ms, pd_err *err) {
    pthread_mutex_lock(&s->mu);
    sconn *k = conn_id >= 0 && conn_id < s->n_conns ? s->conns[conn_id] : NULL;
    pthread_mutex_unlock(&s->mu);
    if (!k) return pd_err_set(err, PD_ERR_CLOSED, "no decode worker %d", conn_id);
    pthread_mutex_lock(&k->kv_mu);
    pd_status st = PD_OK;
    if (!k->comm) {
        st = pd_err_set(err, PD_ERR_CLOSED, "decode worker %d has no communicator", conn_id);
        goto out;
    }
    if (!pd_buffer_reserve(s->p.backend, &k->staging, (size_t)slab->bytes)) {
        st = pd_err_set(err, PD_ERR_NOMEM, "no device memory for a %llu-byte slab", (unsigned long long)slab->bytes);
        goto out;
    }
    fill(ud, pd_buffer_ptr(k->staging));
    pd_kvw_msg m = {.type = PD_KVW_KV_NCCL};
    m.u.kv_nccl = *slab;
    st = send_msg(&k->fd, &k->mu, &m, NULL);
    if (st) {
        pd_err_set(err, st, "decode worker %d is gone", conn_id);
        goto out;
    }
    st = pd_comm_send(k->comm, pd_buffer_ptr(k->staging), (size_t)slab->bytes, 0, err);
    if (!st) st = pd_comm_wait(k->comm, timeout_ms, err);
    if (st) {  // the communicator is aborted: end the connection, the decode worker bootstraps anew
        pthread_mutex_lock(&k->mu);
        if (k->fd >= 0) shutdown(k->fd, SHUT_RDWR);
        pthread_mutex_unlock(&k->mu);
    }
out:
    pthread_mutex_unlock(&k->kv_mu);
    return st;
}
