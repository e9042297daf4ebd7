// xfer.c — see xfer.h. Blocking sockets with deadlines (poll before every read and write), one
// reader and one writer thread per connection: the handoff carries few, large messages per
// request, so an event loop would buy nothing here.
#include "xfer/xfer.h"
#include "wire/link.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/buf.h"
#include "xfer/auth.h"

#define AUTH_MS 5000          // the whole authentication exchange, each side
#define FRAME_MS 10000        // a frame that started arriving must complete within this
#define NCCL_JOIN_MS 20000    // both sides' bound on joining a new communicator
#define LABEL_CLIENT "pdkv3 client"
#define LABEL_SERVER "pdkv3 server"

void pd_xfer_event_fini(pd_xfer_event *ev) {
    pd_free(ev->owned);
    ev->owned = NULL;
    if (ev->fd > 0) close(ev->fd);
    ev->fd = -1;
}

static void count(int64_t *c) { __atomic_add_fetch(c, 1, __ATOMIC_RELAXED); }
static void counters_get(const pd_xfer_counters *src, pd_xfer_counters *out) {
    const int64_t *s = (const int64_t *)src;
    int64_t *o = (int64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(int64_t); i++) o[i] = __atomic_load_n(&s[i], __ATOMIC_RELAXED);
}

// ---- framing with deadlines --------------------------------------------------------------------
static int ms_left(int64_t deadline_us) {
    int64_t l = (deadline_us - pd_time_us()) / 1000;
    return l <= 0 ? 0 : l > 1000000 ? 1000000 : (int)l;
}

// Reads n bytes before deadline_us. An SCM_RIGHTS descriptor that arrives is stored in *fdp
// (the first one; NULL: closed). PD_ERR_TIMEOUT, PD_ERR_CLOSED.
static pd_status read_all(int fd, void *p, size_t n, int64_t deadline_us, int *fdp) {
    char *c = p;
    while (n) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, ms_left(deadline_us));
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) return PD_ERR_TIMEOUT;
        if (pr < 0) return PD_ERR_CLOSED;
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct iovec iov = {.iov_base = c, .iov_len = n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
        ssize_t r = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (r <= 0) return PD_ERR_CLOSED;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            int nfd = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < nfd; i++) {
                int got;
                memcpy(&got, CMSG_DATA(cm) + i * sizeof(int), sizeof got);
                if (fdp && *fdp < 0) *fdp = got;
                else close(got);
            }
        }
        c += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

// Writes n bytes; fails when no progress was possible for stall_ms. fd_pass >= 0 rides along with
// the first byte (SCM_RIGHTS).
static pd_status write_all(int fd, const void *p, size_t n, int stall_ms, int fd_pass) {
    const char *c = p;
    while (n) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int pr = poll(&pfd, 1, stall_ms);
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) return PD_ERR_TIMEOUT;
        if (pr < 0 || (pfd.revents & (POLLERR | POLLHUP | POLLNVAL))) return PD_ERR_CLOSED;
        struct iovec iov = {.iov_base = (void *)c, .iov_len = n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } ctl;
        if (fd_pass >= 0) {
            memset(&ctl, 0, sizeof ctl);
            mh.msg_control = ctl.b;
            mh.msg_controllen = sizeof ctl.b;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &fd_pass, sizeof(int));
        }
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (w <= 0) return PD_ERR_CLOSED;
        fd_pass = -1;
        c += w;
        n -= (size_t)w;
    }
    return PD_OK;
}

// Reads one frame's header + body into *buf (grown as needed, at most max_body) and decodes it.
// The type must be allowed (bit per type in allow). KV_SLAB: only header + body are read; the
// payload (m->u.kv_slab.payload_len bytes, payload NULL) is left on the socket for the caller.
// The first byte may wait until idle_deadline_us; the rest of the frame must follow within FRAME_MS.
static pd_status recv_frame(int fd, uint8_t **buf, size_t *cap, pd_kvw_msg *m, uint32_t allow, uint32_t max_body,
                            int64_t idle_deadline_us, int *fdp, pd_err *err) {
    memset(m, 0, sizeof *m);
    if (PD_ARRAY_RESERVE(*buf, *cap, 4096)) return PD_ERR_NOMEM;
    pd_status st = read_all(fd, *buf, 1, idle_deadline_us, fdp);
    if (st) return st;
    st = read_all(fd, *buf + 1, PD_KVW_HDR - 1, pd_time_us() + FRAME_MS * 1000ll, fdp);
    if (st) return st == PD_ERR_TIMEOUT ? pd_err_set(err, PD_ERR_PROTO, "frame header stalled") : st;
    uint64_t total = pd_kvw_peek_len(*buf);
    pd_kvw_type t = pd_kvw_peek_type(*buf);
    if (!total || t >= 32 || !(allow & (1u << t))) return pd_err_set(err, PD_ERR_PROTO, "unexpected or invalid frame header");
    uint64_t payload = 0;
    for (int i = 0; i < 8; i++) payload |= (uint64_t)(*buf)[16 + i] << (8 * i);
    uint64_t body = total - PD_KVW_HDR - payload;
    if (body > max_body) return pd_err_set(err, PD_ERR_PROTO, "frame body of %llu bytes over the cap", (unsigned long long)body);
    if (PD_ARRAY_RESERVE(*buf, *cap, (size_t)(PD_KVW_HDR + body))) return PD_ERR_NOMEM;
    st = read_all(fd, *buf + PD_KVW_HDR, (size_t)body, pd_time_us() + FRAME_MS * 1000ll, fdp);
    if (st) return st == PD_ERR_TIMEOUT ? pd_err_set(err, PD_ERR_PROTO, "frame body stalled") : st;
    memset(*buf + 16, 0, 8);  // the payload (if any) is not buffered: decode header + body alone
    size_t used;
    st = pd_kvw_decode(*buf, (size_t)(PD_KVW_HDR + body), m, &used, err);
    if (st == PD_OK && t == PD_KVW_KV_SLAB) m->u.kv_slab.payload_len = payload, m->u.kv_slab.payload = NULL;
    return st == PD_AGAIN ? pd_err_set(err, PD_ERR_PROTO, "short frame") : st;
}

static pd_status send_now(int fd, const pd_kvw_msg *m, int fd_pass) {
    pd_kvw_buf b = {0};
    pd_status st = pd_kvw_encode(&b, m);
    if (st == PD_OK) st = write_all(fd, b.data, b.len, FRAME_MS, fd_pass);
    pd_kvw_buf_fini(&b);
    return st;
}

// ---- the outbound queue (one writer thread per connection) -------------------------------------
typedef struct oframe {
    struct oframe *next;
    uint8_t *data;
    size_t len;
    void *payload;  // owned (KV_SLAB)
    size_t payload_len;
} oframe;

typedef struct outq {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    oframe *head, *tail;
    size_t bytes, cap_bytes;
    int fd, stall_ms;
    bool closed, started;
    pthread_t thread;
    int64_t *slow_counter;
} outq;

static void outq_init(outq *q, int fd, size_t cap_bytes, int stall_ms, int64_t *slow_counter) {
    memset(q, 0, sizeof *q);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->fd = fd;
    q->cap_bytes = cap_bytes;
    q->stall_ms = stall_ms;
    q->slow_counter = slow_counter;
}

static void oframe_free(oframe *f) {
    pd_free(f->data);
    pd_free(f->payload);
    pd_free(f);
}

static void *outq_main(void *arg) {
    outq *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (!q->head && !q->closed) pthread_cond_wait(&q->cv, &q->mu);
        oframe *f = q->head;
        if (!f || q->closed) {
            pthread_mutex_unlock(&q->mu);
            break;
        }
        q->head = f->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->mu);
        // No lock held while writing.
        pd_status st = write_all(q->fd, f->data, f->len, q->stall_ms, -1);
        if (st == PD_OK && f->payload_len) st = write_all(q->fd, f->payload, f->payload_len, q->stall_ms, -1);
        pthread_mutex_lock(&q->mu);
        q->bytes -= f->payload_len;
        pthread_mutex_unlock(&q->mu);
        oframe_free(f);
        if (st) {
            if (st == PD_ERR_TIMEOUT && q->slow_counter) count(q->slow_counter);
            if (st == PD_ERR_TIMEOUT) PD_LOG_W("xfer: a peer stopped reading for %d ms: closing the connection", q->stall_ms);
            pthread_mutex_lock(&q->mu);
            q->closed = true;
            pthread_mutex_unlock(&q->mu);
            shutdown(q->fd, SHUT_RDWR);  // wakes the reader: the connection ends
            break;
        }
    }
    return NULL;
}

static bool outq_start(outq *q) {
    q->started = pthread_create(&q->thread, NULL, outq_main, q) == 0;
    return q->started;
}

// Queues m (+ payload, taken over). Never blocks on I/O.
static pd_status outq_push(outq *q, const pd_kvw_msg *m, void *payload) {
    size_t plen = m->type == PD_KVW_KV_SLAB ? (size_t)m->u.kv_slab.payload_len : 0;
    oframe *f = pd_calloc(1, sizeof *f);
    pd_kvw_buf b = {0};
    if (!f || pd_kvw_encode(&b, m)) {
        pd_free(f);
        pd_kvw_buf_fini(&b);
        pd_free(payload);
        return PD_ERR_NOMEM;
    }
    f->data = b.data;
    f->len = b.len;
    f->payload = payload;
    f->payload_len = plen;
    pthread_mutex_lock(&q->mu);
    pd_status st = PD_OK;
    if (q->closed) st = PD_ERR_CLOSED;
    else if (plen && q->bytes + plen > q->cap_bytes) st = PD_NOSPACE;
    if (st == PD_OK) {
        if (q->tail) q->tail->next = f;
        else q->head = f;
        q->tail = f;
        q->bytes += plen;
        pthread_cond_signal(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    if (st) {
        if (st == PD_NOSPACE && q->slow_counter) count(q->slow_counter);
        oframe_free(f);
    }
    return st;
}

// Stops the writer (dropping what is queued) and joins it. The fd stays open (the owner closes).
static void outq_stop(outq *q) {
    pthread_mutex_lock(&q->mu);
    q->closed = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (q->started) pthread_join(q->thread, NULL);
    q->started = false;
    for (oframe *f = q->head, *n; f; f = n) {
        n = f->next;
        oframe_free(f);
    }
    q->head = q->tail = NULL;
    q->bytes = 0;
}

static void outq_fini(outq *q) {
    outq_stop(q);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
}

// ---- dialing -----------------------------------------------------------------------------------
static void abstract_addr(int port, struct sockaddr_un *sa, socklen_t *len) {
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "pdserve-kv-%d", port);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static int connect_deadline(int fd, const struct sockaddr *sa, socklen_t len, int timeout_ms) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    int r = connect(fd, sa, len);
    if (r < 0 && errno != EINPROGRESS && errno != EAGAIN) return -1;
    if (r < 0) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        if (poll(&pfd, 1, timeout_ms) != 1) return -1;
        int e = 0;
        socklen_t el = sizeof e;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) || e) return -1;
    }
    return 0;
}

// "host:port" -> a connected socket (shm: the prefill worker's abstract unix socket for port).
static int dial(const char *addr, bool unix_sock, int timeout_ms) {
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || (size_t)(colon - addr) >= sizeof host) return -1;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    if (unix_sock) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa;
        socklen_t sl;
        abstract_addr(atoi(colon + 1), &sa, &sl);
        if (fd >= 0 && connect_deadline(fd, (struct sockaddr *)&sa, sl, timeout_ms)) {
            close(fd);
            fd = -1;
        }
        return fd;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &res) || !res) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect_deadline(fd, res->ai_addr, res->ai_addrlen, timeout_ms)) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

// ---- decode side -------------------------------------------------------------------------------
typedef struct inflight {
    uint64_t req_id;
    int64_t deadline_us;
    bool timed_out;          // cancelled at its deadline; blocks stay reserved until the answer
    int64_t grace_end_us;    // timed out: drop the connection if no answer by then
    int32_t start_pos, n_tokens;
    int32_t *dst_blocks;     // owned (tcp: where slabs land)
    int32_t n_dst_blocks;
    int32_t n_landed;        // tcp, nccl: layers landed
    int64_t t_sent_us;       // queued (the link model's transfer samples)
} inflight;

typedef struct worker {
    pd_xfer_client *c;  // borrowed back-pointer
    int idx;
    char addr[256];
    pthread_t thread;
    pthread_mutex_t mu;      // guards inf, healthy, q_live (never held across I/O)
    bool healthy, q_live;
    outq q;                  // the current connection's writer (valid while q_live)
    inflight *inf;
    int n_inf;
    size_t cap_inf;  // PD_ARRAY_RESERVE
    int peer_pidfd;          // shm: the prefill process (fencing), else -1
    // nccl transport (I/O thread only)
    pd_comm *comm;       // this connection's communicator (rank 0)
    pd_buffer *staging;  // receive slab, grown as needed
    uint8_t *discard;    // scratch for slab bytes that are not ours to land
    // the link model (under mu): probe at connect, pings, real transfers (wire/link.h)
    double rtt_us;           // EMA of ping round trips; -1 unknown
    pd_link_fit xfer_fit;    // the probe's transfer µs over bytes: a = latency, b = 1 / bandwidth
    double xfer_factor;      // EMA over real transfers: their time after compute / the probe's prediction; -1 unknown
    double compute_us_tok;   // EMA of the worker's compute µs per prompt token (real transfers); -1 unknown
    double remote_a_us, remote_b_us;  // the worker's own step-time model (PROBE_DATA); < 0 unknown
    uint32_t remote_chunk;
    int64_t n_probes, n_transfers;
    int64_t t_probe_us;      // the last probe round sent (I/O thread)
    uint64_t probe_cum;      // bytes of the current round answered so far (answers come in order)
} worker;

typedef struct queued {     // a request waiting in the work queue for a prefill worker's claim
    pd_kvw_prefill_req req;    // tokens / dst_blocks point into owned
    int32_t *owned;
    int64_t deadline_us;
} queued;

struct pd_xfer_client {
    pd_xfer_client_params p;
    char *secret;
    worker workers[PD_XFER_MAX_WORKERS];
    pthread_mutex_t qmu;       // guards queue (never held across I/O or a callback)
    queued *queue;
    int n_queue;
    size_t cap_queue;
    pthread_t q_thread;        // expires unclaimed requests (only with on_enqueue)
    bool has_q_thread;
    pd_xfer_counters ctr;
    int stop;  // atomic
};

void pd_xfer_client_counters(pd_xfer_client *c, pd_xfer_counters *out) { counters_get(&c->ctr, out); }

// Transports whose writer puts bytes straight into our pool (fenced after a lost connection).
static bool is_direct(pd_kvw_transport t) {
    return t == PD_KVW_TRANSPORT_SHM || t == PD_KVW_TRANSPORT_CUDA_IPC || t == PD_KVW_TRANSPORT_UCX;
}

static void emit_result(pd_xfer_client *c, int widx, uint64_t id, pd_status st, const char *reason, const pd_kvw_prefill_done *d) {
    pd_xfer_event ev = {.kind = PD_XFER_EV_RESULT, .conn_id = widx, .req_id = id, .status = st, .fd = -1};
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

// Reads n payload bytes: into dst, or (dst NULL) into the discard scratch.
static pd_status read_payload(worker *w, int fd, uint8_t *dst, size_t n) {
    while (n) {
        size_t k = PD_MIN(n, (size_t)1 << 20);
        if (!dst && !w->discard && !(w->discard = pd_malloc((size_t)1 << 20))) return PD_ERR_NOMEM;
        pd_status st = read_all(fd, dst ? dst : w->discard, k, pd_time_us() + FRAME_MS * 1000ll, NULL);
        if (st) return st;
        if (dst) dst += k;
        n -= k;
    }
    return PD_OK;
}

// tcp transport: the payload is read straight into the request's reserved blocks (K rows of every
// block, then V rows), after its geometry was checked against the request, byte for byte. Bytes
// for a request that is gone or timed out are read and dropped. Returns NULL, or why the
// connection must be dropped.
static const char *land_slab(worker *w, int fd, const pd_kvw_kv_slab *s) {
    const pd_xfer_pool *pool = &w->c->p.pool;
    pthread_mutex_lock(&w->mu);
    inflight *f = NULL;
    for (int i = 0; i < w->n_inf; i++)
        if (w->inf[i].req_id == s->req_id) f = &w->inf[i];
    bool ours = f && !f->timed_out;
    // Entries are removed only by this thread: the block list stays valid after unlocking.
    const int32_t *blocks = f ? f->dst_blocks : NULL;
    int32_t nb = f ? f->n_dst_blocks : 0, rows_want = f ? f->n_tokens - f->start_pos : 0;
    pthread_mutex_unlock(&w->mu);
    size_t layer_cap = 2 * (size_t)pool->n_blocks * (size_t)pool->block_size * pool->row_bytes;
    if (!pool->n_layers || s->layer >= pool->n_layers || s->row_bytes != pool->row_bytes ||
        s->n_rows_last > pool->block_size || s->payload_len > layer_cap)
        return "KV_SLAB geometry does not match our pool";
    if (!f) return read_payload(w, fd, NULL, (size_t)s->payload_len) ? "connection lost mid-slab" : NULL;
    size_t rows = (size_t)(s->n_blocks - 1) * (size_t)pool->block_size + (size_t)s->n_rows_last;
    if (s->n_blocks != nb || rows != (size_t)rows_want || s->payload_len != 2 * rows * pool->row_bytes)
        return "KV_SLAB does not match its request";
    if (!ours) return read_payload(w, fd, NULL, (size_t)s->payload_len) ? "connection lost mid-slab" : NULL;
    size_t bb = pool->row_bytes * (size_t)pool->block_size;
    for (int kv = 0; kv < 2; kv++) {
        uint8_t *base = kv ? pool->v[s->layer] : pool->k[s->layer];
        for (int i = 0; i < nb; i++) {
            size_t n = pool->row_bytes * (size_t)(i == nb - 1 ? s->n_rows_last : pool->block_size);
            if (read_payload(w, fd, base + (size_t)blocks[i] * bb, n)) return "connection lost mid-slab";
        }
    }
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_inf; i++)
        if (w->inf[i].req_id == s->req_id) w->inf[i].n_landed++;
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

// nccl transport: receives the announced layer (always: the communicator's order must stay in step
// with the sender) and scatters it into that layer of the request's blocks if they are still
// reserved for it and it is the request's next layer. Both are waited for (bounded by the load
// timeout: a peer that does not send aborts the communicator) before the next frame is read, so
// one staging slab of one layer serves every announcement. Returns NULL, or why the connection
// must be dropped.
static const char *land_nccl(worker *w, const pd_kvw_kv_nccl *s) {
    pd_xfer_client *c = w->c;
    const pd_xfer_pool *pool = &c->p.pool;
    if (!w->comm) return "KV_NCCL on a connection without a communicator";
    pd_err err = {0};
    if (s->n_layers != pool->n_layers || s->block_size != pool->block_size || s->row_bytes != pool->row_bytes ||
        s->n_blocks > pool->n_blocks)
        return "KV_NCCL geometry does not match our pool";
    if (!pd_buffer_reserve(c->p.backend, &w->staging, (size_t)s->bytes)) return "out of device memory for an nccl slab";
    char *stg = pd_buffer_ptr(w->staging);
    if (pd_comm_recv(w->comm, stg, (size_t)s->bytes, 1, &err) || pd_comm_wait(w->comm, c->p.timeout_ms, &err)) {
        PD_LOG_W("xfer: %s", err.msg);
        return "nccl transfer failed";
    }
    int nb = s->n_blocks, L = s->n_layers, bs = s->block_size, l = s->layer;
    int32_t *idx = pd_malloc(sizeof(int32_t) * 3 * (size_t)nb);  // src blocks, dst blocks, rows
    void **ptrs = pd_calloc(2 * (size_t)L, sizeof(void *));        // slab K, V bases (layer l only)
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
        int rows = (nb - 1) * bs + s->n_rows_last;
        geom_ok = nb == f->n_dst_blocks && rows == f->n_tokens - f->start_pos && l == f->n_landed;
        for (int b = 0; b < nb && geom_ok; b++)
            idx[b] = b, idx[nb + b] = f->dst_blocks[b], idx[2 * nb + b] = b == nb - 1 ? s->n_rows_last : bs;
    }
    pthread_mutex_unlock(&w->mu);
    const char *why = NULL;
    if (found && !geom_ok) {
        why = "KV_NCCL slab does not match its request (geometry or layer order)";
    } else if (found) {
        pd_kvw_kv_nccl_split(s, stg, &ptrs[l], &ptrs[L + l]);
        pd_kv_copy_params kp = {.src_k = ptrs, .src_v = ptrs + L, .dst_k = pool->k, .dst_v = pool->v, .src_blocks = idx,
                                .dst_blocks = idx + nb, .n_rows = idx + 2 * nb, .n_blocks = nb, .layer_begin = l,
                                .layer_end = l + 1, .block_size = bs, .row_bytes = (size_t)s->row_bytes};
        pd_comm_kv_copy(w->comm, &kp);
        if (pd_comm_wait(w->comm, c->p.timeout_ms, &err)) {
            PD_LOG_W("xfer: %s", err.msg);
            why = "nccl scatter failed";
        } else {
            pthread_mutex_lock(&w->mu);  // layer l is in place (pd_xfer_client_layers_landed)
            for (int i = 0; i < w->n_inf; i++)
                if (w->inf[i].req_id == s->req_id) w->inf[i].n_landed++;
            pthread_mutex_unlock(&w->mu);
        }
    }
    pd_free(idx);
    pd_free(ptrs);
    return why;
}

#define N_PROBES 3
static const uint32_t PROBE_SIZES[N_PROBES] = {4096, 256 << 10, 1 << 20};
#define REPROBE_MS 5000  // re-probe an idle link this often (~1.3 MiB: about 2% of 100 Mbit/s)

// Returns NULL, or why the connection must be dropped.
static const char *handle_client_msg(worker *w, int fd, const pd_kvw_msg *m, int64_t *last_pong) {
    inflight f;
    switch (m->type) {
    case PD_KVW_PONG: {
        int64_t now = pd_time_us(), rtt = now - (int64_t)m->u.ping.nonce;
        *last_pong = now;
        if (rtt >= 0 && rtt < 10000000) {
            pthread_mutex_lock(&w->mu);
            w->rtt_us = w->rtt_us < 0 ? (double)rtt : 0.8 * w->rtt_us + 0.2 * (double)rtt;
            pthread_mutex_unlock(&w->mu);
        }
        break;
    }
    case PD_KVW_PROBE_DATA: {  // a re-probe round's answer: (bytes of the round so far, time since sent)
        int64_t el = pd_time_us() - (int64_t)m->u.probe.nonce;
        pthread_mutex_lock(&w->mu);
        w->probe_cum += m->u.probe.bytes;
        w->remote_a_us = m->u.probe.step_a_us, w->remote_b_us = m->u.probe.step_b_us, w->remote_chunk = m->u.probe.chunk_tokens;
        if (el > 0 && el < 60000000) pd_link_fit_add(&w->xfer_fit, (double)w->probe_cum, (double)el, 0.1);
        if (m->u.probe.bytes == PROBE_SIZES[N_PROBES - 1]) w->n_probes++;
        pthread_mutex_unlock(&w->mu);
        break;
    }
    case PD_KVW_KV_SLAB:
        if (w->c->p.transport != PD_KVW_TRANSPORT_TCP) return "KV_SLAB on a connection that is not tcp";
        return land_slab(w, fd, &m->u.kv_slab);
    case PD_KVW_PREFILL_DONE:
    case PD_KVW_PREFILL_FAIL: {
        uint64_t id = m->type == PD_KVW_PREFILL_DONE ? m->u.done.req_id : m->u.fail.req_id;
        pthread_mutex_lock(&w->mu);
        bool had = take_inflight(w, id, &f);
        if (had && m->type == PD_KVW_PREFILL_DONE && !f.timed_out && f.n_tokens > f.start_pos) {
            // The link model's real samples: the worker's own compute time per prompt, and what
            // is left of request → DONE after its queue and compute: the transfer (and latency).
            // Layer-wise transports hide part of the transfer behind compute: what is left after
            // compute, over what the probe predicts for these bytes, scales the transfer term.
            const pd_kvw_prefill_done *d = &m->u.done;
            int n_tok = f.n_tokens - f.start_pos;
            double total = (double)(pd_time_us() - f.t_sent_us), xfer_us = total - (double)d->queue_us - (double)d->compute_us;
            double bytes = 2.0 * w->c->p.pool.n_layers * (double)w->c->p.pool.row_bytes * n_tok;
            if (d->compute_us > 0) {
                double v = (double)d->compute_us / n_tok;
                w->compute_us_tok = w->compute_us_tok < 0 ? v : 0.7 * w->compute_us_tok + 0.3 * v;
            }
            double pa, pb;
            if (pd_link_fit_get(&w->xfer_fit, &pa, &pb) && pa + pb * bytes > 0) {
                double r = PD_MAX(0.0, PD_MIN(2.0, xfer_us / (pa + pb * bytes)));
                w->xfer_factor = w->xfer_factor < 0 ? r : 0.7 * w->xfer_factor + 0.3 * r;
            }
            w->n_transfers++;
        }
        pthread_mutex_unlock(&w->mu);
        if (!had) break;  // a late duplicate
        pd_free(f.dst_blocks);
        // A timed-out request ends here: the worker is done with its blocks, the engine may reuse them.
        if (f.timed_out) emit_result(w->c, w->idx, id, PD_ERR_TIMEOUT, "prefill timed out", NULL);
        else if (m->type == PD_KVW_PREFILL_DONE) emit_result(w->c, w->idx, id, PD_OK, NULL, &m->u.done);
        else if (m->u.fail.code == PD_KVW_FAIL_POOL_REFUSED) emit_result(w->c, w->idx, id, PD_ERR_UNSUPPORTED, m->u.fail.reason, NULL);
        else emit_result(w->c, w->idx, id, PD_ERR_INVALID, m->u.fail.reason, NULL);
        break;
    }
    case PD_KVW_KV_NCCL: {
        if (w->c->p.transport != PD_KVW_TRANSPORT_NCCL) return "KV_NCCL on a connection that is not nccl";
        const char *why = land_nccl(w, &m->u.kv_nccl);
        if (!why) *last_pong = pd_time_us();  // the peer took part in a transfer: it is alive (the
        return why;                           // wait may have outlasted the heartbeat window)
    }
    default: return "unexpected message";
    }
    return NULL;
}

// The link probe at connect (after authentication): PROBE_SIZES answers of growing size, each
// timed from our request to its last byte. They seed the link model's transfer fit (latency and
// bandwidth); real transfers refine it. Best effort: a failed probe only leaves the model unknown.
static bool link_probe(worker *w, int fd, uint8_t **buf, size_t *cap) {
    double us[N_PROBES];
    for (int i = 0; i < N_PROBES; i++) {
        pd_kvw_msg q = {.type = PD_KVW_PROBE}, m;
        int64_t t0 = pd_time_us();
        q.u.probe.nonce = (uint64_t)t0;
        q.u.probe.bytes = PROBE_SIZES[i];
        pd_err err = {0};
        if (send_now(fd, &q, -1)) return false;
        if (recv_frame(fd, buf, cap, &m, 1u << PD_KVW_PROBE_DATA, pd_kvw_max_body(PD_KVW_PROBE_DATA),
                       pd_time_us() + 5000000, NULL, &err) ||
            m.u.probe.nonce != q.u.probe.nonce || m.u.probe.bytes != q.u.probe.bytes) {
            PD_LOG_W("xfer: link probe to %s failed: %s", w->addr, err.msg[0] ? err.msg : "wrong answer");
            return false;
        }
        us[i] = (double)(pd_time_us() - t0);
        pthread_mutex_lock(&w->mu);
        w->remote_a_us = m.u.probe.step_a_us, w->remote_b_us = m.u.probe.step_b_us, w->remote_chunk = m.u.probe.chunk_tokens;
        pthread_mutex_unlock(&w->mu);
    }
    pthread_mutex_lock(&w->mu);
    w->rtt_us = w->rtt_us < 0 ? us[0] : 0.5 * w->rtt_us + 0.5 * us[0];
    for (int i = 0; i < N_PROBES; i++) pd_link_fit_add(&w->xfer_fit, (double)PROBE_SIZES[i], us[i], 0.2);
    w->n_probes++;
    w->t_probe_us = pd_time_us();
    double a = 0, b = 0;
    bool ok = pd_link_fit_get(&w->xfer_fit, &a, &b);
    pthread_mutex_unlock(&w->mu);
    PD_LOG_I("xfer: link to %s: rtt %.0f us, %.1f MB/s (probe)", w->addr, us[0], ok && b > 0 ? 1.0 / b : -1.0);
    return true;
}

static bool handshake(worker *w, int fd) {
    pd_xfer_client *c = w->c;
    uint8_t *buf = NULL;
    size_t cap = 0;
    pd_kvw_msg m;
    pd_err err = {0};
    int64_t dl = pd_time_us() + AUTH_MS * 1000ll;
    bool ok = false;
    pd_comm_id cid;
    // 1. the server's challenge; 2. our proof; 3. the server's proof.
    if (recv_frame(fd, &buf, &cap, &m, 1u << PD_KVW_AUTH_CHALLENGE, PD_KVW_NONCE, dl, NULL, &err)) goto out;
    uint8_t ns[PD_KVW_NONCE];
    memcpy(ns, m.u.auth.nonce, sizeof ns);
    pd_kvw_msg proof = {.type = PD_KVW_AUTH_PROOF};
    pd_auth_nonce(proof.u.auth.nonce);
    pd_auth_mac(c->secret, LABEL_CLIENT, ns, proof.u.auth.nonce, proof.u.auth.mac);
    if (send_now(fd, &proof, -1)) goto out;
    if (recv_frame(fd, &buf, &cap, &m, 1u << PD_KVW_AUTH_OK, PD_KVW_MAC, dl, NULL, &err)) {
        PD_LOG_W("xfer: prefill worker %s refused our authentication (is the auth token the same?)", w->addr);
        count(&c->ctr.auth_failures);
        goto out;
    }
    uint8_t want[32];
    pd_auth_mac(c->secret, LABEL_SERVER, proof.u.auth.nonce, ns, want);
    if (!pd_auth_mac_equal(want, m.u.auth.mac)) {
        PD_LOG_W("xfer: %s did not prove the shared secret: not talking to it", w->addr);
        count(&c->ctr.auth_failures);
        goto out;
    }
    // 4. HELLO: fingerprint and how to reach our pool (the memfd rides along for shm).
    pd_kvw_msg h = {.type = PD_KVW_HELLO};
    h.u.hello.fp = c->p.fp;
    h.u.hello.transport = (uint32_t)c->p.transport;
    h.u.hello.pool_n_blocks = (uint32_t)c->p.pool.n_blocks;
    int fd_pass = -1;
    if (c->p.transport == PD_KVW_TRANSPORT_NCCL) {
        if (pd_comm_id_new(c->p.backend, &cid, &err)) {
            PD_LOG_W("xfer: %s", err.msg);
            goto out;
        }
        h.u.hello.handle_len = sizeof cid;
        memcpy(h.u.hello.handle, &cid, sizeof cid);
    } else if (c->p.transport == PD_KVW_TRANSPORT_UCX) {
        if (!c->p.hello_blob_len || c->p.hello_blob_len > sizeof h.u.hello.handle) goto out;
        h.u.hello.handle_len = c->p.hello_blob_len;
        memcpy(h.u.hello.handle, c->p.hello_blob, c->p.hello_blob_len);
    } else if (is_direct(c->p.transport)) {
        pd_buffer_handle hd = c->p.pool_handle;
        fd_pass = c->p.transport == PD_KVW_TRANSPORT_SHM ? hd.fd : -1;
        hd.fd = -1;
        h.u.hello.handle_len = sizeof hd;
        memcpy(h.u.hello.handle, &hd, sizeof hd);
        if (c->p.transport == PD_KVW_TRANSPORT_SHM && fd_pass < 0) goto out;
    }
    if (send_now(fd, &h, fd_pass)) goto out;
    if (recv_frame(fd, &buf, &cap, &m, 1u << PD_KVW_HELLO_ACK, pd_kvw_max_body(PD_KVW_HELLO_ACK),
                   pd_time_us() + AUTH_MS * 1000ll, NULL, &err))
        goto out;
    if (!m.u.hello_ack.ok) {
        PD_LOG_W("xfer: prefill worker %s refused us: %s", w->addr, m.u.hello_ack.error);
        goto out;
    }
    ok = true;
    if (c->p.transport == PD_KVW_TRANSPORT_NCCL) {
        // The prefill worker joins right after its HELLO_ACK; both sides wait at most this long.
        w->comm = pd_comm_new(c->p.backend, &cid, 2, 0, NCCL_JOIN_MS, &err);
        if (!w->comm) PD_LOG_W("xfer: nccl bootstrap with %s failed: %s", w->addr, err.msg);
        ok = w->comm != NULL;
    }
    // The link probe (the prefill worker answers once its loop runs: after HELLO_ACK, and for nccl
    // after it joined the communicator).
    if (ok && !link_probe(w, fd, &buf, &cap))
        PD_LOG_W("xfer: %s: no link probe; the link model waits for real transfers", w->addr);
out:
    if (!ok && err.msg[0]) PD_LOG_D("xfer: handshake with %s: %s", w->addr, err.msg);
    pd_free(buf);
    return ok;
}

// Per-request deadlines: a request past its deadline is cancelled but stays registered (the
// engine's blocks stay reserved) until the worker answers. Returns true when a cancelled request
// stayed unanswered past the grace period (the connection is then dropped).
static bool check_deadlines(worker *w, int64_t now) {
    pd_xfer_client *c = w->c;
    bool unanswered = false;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_inf; i++) {
        inflight *f = &w->inf[i];
        if (f->timed_out) {
            unanswered |= f->grace_end_us < now;
        } else if (f->deadline_us < now) {
            f->timed_out = true;
            f->grace_end_us = now + (int64_t)c->p.cancel_grace_ms * 1000;
            PD_LOG_W("xfer: request %llu timed out on %s: cancelled, its blocks stay reserved until the worker answers",
                     (unsigned long long)f->req_id, w->addr);
            pd_kvw_msg cm = {.type = PD_KVW_CANCEL};
            cm.u.cancel.req_id = f->req_id;
            if (w->q_live) outq_push(&w->q, &cm, NULL);
        }
    }
    pthread_mutex_unlock(&w->mu);
    return unanswered;
}

// After a lost connection of a direct transport: the prefill worker may be in the middle of a
// layer write into our pool. Wait until its process has exited, or fence_ms (it checks the
// connection before each layer), whichever is first.
static void fence(worker *w) {
    pd_xfer_client *c = w->c;
    pthread_mutex_lock(&w->mu);
    int n = w->n_inf;
    pthread_mutex_unlock(&w->mu);
    if (!n || !is_direct(c->p.transport)) return;
    int64_t end = pd_time_us() + (int64_t)c->p.fence_ms * 1000;
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) && pd_time_us() < end) {
        if (w->peer_pidfd >= 0) {
            struct pollfd pfd = {.fd = w->peer_pidfd, .events = POLLIN};
            if (poll(&pfd, 1, PD_MIN(50, ms_left(end))) == 1) break;  // the writer is dead
        } else {
            poll(NULL, 0, PD_MIN(50, ms_left(end)));
        }
    }
    __atomic_add_fetch(&c->ctr.fenced, n, __ATOMIC_RELAXED);
}

static void *worker_main(void *arg) {
    worker *w = arg;
    pd_xfer_client *c = w->c;
    uint8_t *buf = NULL;
    size_t cap = 0;
    int backoff_ms = 50;
    bool unix_sock = c->p.transport == PD_KVW_TRANSPORT_SHM;
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
        int fd = dial(w->addr, unix_sock, c->p.ping_ms * 4);
        w->peer_pidfd = -1;
        if (fd >= 0 && unix_sock) {
            struct ucred uc;
            socklen_t ul = sizeof uc;
            if (!getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &ul)) w->peer_pidfd = (int)syscall(SYS_pidfd_open, uc.pid, 0);
        }
        if (fd < 0 || !handshake(w, fd)) {
            if (fd >= 0) close(fd);
            if (w->peer_pidfd >= 0) close(w->peer_pidfd);
            for (int i = 0; i < backoff_ms / 10 && !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE); i++) poll(NULL, 0, 10);
            backoff_ms = PD_MIN(backoff_ms * 2, 1000);
            continue;
        }
        backoff_ms = 50;
        outq_init(&w->q, fd, SIZE_MAX, FRAME_MS, &c->ctr.slow_peer_drops);
        bool started = outq_start(&w->q);
        pthread_mutex_lock(&w->mu);
        w->q_live = w->healthy = started;
        pthread_mutex_unlock(&w->mu);
        PD_LOG_I("xfer: connected to prefill worker %s (%s)", w->addr, pd_kvw_transport_name(c->p.transport));
        int64_t last_ping = pd_time_us(), last_pong = last_ping;
        const char *why = "prefill worker connection lost";
        pd_status why_st = PD_ERR_CLOSED;
        while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) && started) {
            pd_kvw_msg m;
            pd_err err = {0};
            uint32_t allow = 1u << PD_KVW_PONG | 1u << PD_KVW_KV_SLAB | 1u << PD_KVW_PREFILL_DONE |
                             1u << PD_KVW_PREFILL_FAIL | 1u << PD_KVW_KV_NCCL | 1u << PD_KVW_PROBE_DATA;
            pd_status st = recv_frame(fd, &buf, &cap, &m, allow, pd_kvw_max_body(PD_KVW_PROBE_DATA),
                                      pd_time_us() + 50000, NULL, &err);
            if (st && st != PD_ERR_TIMEOUT) {
                if (st == PD_ERR_PROTO) {
                    why = "protocol error from prefill worker", why_st = PD_ERR_PROTO;
                    count(&c->ctr.proto_errors);
                    PD_LOG_W("xfer: %s: %s", w->addr, err.msg);
                }
                break;
            }
            if (st == PD_OK) {
                // Anything the worker sends proves it alive: on a slow link its PONGs queue behind
                // KV slabs and probe answers for seconds (25 Mbit/s, a few MB in flight), which
                // must not read as "stopped answering heartbeats".
                const char *drop = handle_client_msg(w, fd, &m, &last_pong);
                last_pong = pd_time_us();  // (after: a slab's payload may take a while to read)
                pd_kvw_msg_fini(&m);
                if (drop) {
                    why = drop, why_st = PD_ERR_PROTO;
                    count(&c->ctr.proto_errors);
                    break;
                }
            }
            int64_t now = pd_time_us();
            pthread_mutex_lock(&w->mu);
            bool idle = w->n_inf == 0;
            pthread_mutex_unlock(&w->mu);
            if (idle && now - w->t_probe_us >= REPROBE_MS * 1000ll) {  // one round, sent back to back
                w->t_probe_us = now;
                pthread_mutex_lock(&w->mu);
                w->probe_cum = 0;
                pthread_mutex_unlock(&w->mu);
                for (int i = 0; i < N_PROBES; i++) {
                    pd_kvw_msg pr = {.type = PD_KVW_PROBE};
                    pr.u.probe.nonce = (uint64_t)now;
                    pr.u.probe.bytes = PROBE_SIZES[i];
                    if (outq_push(&w->q, &pr, NULL)) break;
                }
            }
            if (now - last_ping >= (int64_t)c->p.ping_ms * 1000) {
                pd_kvw_msg ping = {.type = PD_KVW_PING};
                ping.u.ping.nonce = (uint64_t)now;
                if (outq_push(&w->q, &ping, NULL)) break;
                last_ping = now;
            }
            if (now - last_pong > (int64_t)c->p.ping_ms * 4000) {
                why = "prefill worker stopped answering heartbeats";
                why_st = PD_ERR_TIMEOUT;
                break;
            }
            if (check_deadlines(w, now)) {
                why = "prefill worker did not answer a cancelled request";
                why_st = PD_ERR_TIMEOUT;
                break;
            }
        }
        pthread_mutex_lock(&w->mu);
        w->q_live = w->healthy = false;
        pthread_mutex_unlock(&w->mu);
        shutdown(fd, SHUT_RDWR);
        outq_fini(&w->q);
        close(fd);
        pd_comm_free(w->comm);  // aborts anything in flight: nothing lands after this
        w->comm = NULL;
        if (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) PD_LOG_W("xfer: %s (%s); in-flight requests fall back", why, w->addr);
        fence(w);
        if (w->peer_pidfd >= 0) close(w->peer_pidfd);
        w->peer_pidfd = -1;
        fail_all(w, why_st, why);
    }
    pd_free(buf);
    return NULL;
}

static void *queue_main(void *arg);

pd_xfer_client *pd_xfer_client_new(const pd_xfer_client_params *p, pd_err *err) {
    if (p->n_workers <= 0 || p->n_workers > PD_XFER_MAX_WORKERS || !p->on_event) {
        pd_err_set(err, PD_ERR_INVALID, "xfer client: 1..%d prefill workers and a callback are needed", PD_XFER_MAX_WORKERS);
        return NULL;
    }
    if (!p->secret || strlen(p->secret) < PD_AUTH_MIN_LEN) {
        pd_err_set(err, PD_ERR_INVALID, "the KV connection needs a shared secret (--auth-token-file)");
        return NULL;
    }
    if (p->transport == PD_KVW_TRANSPORT_NCCL && !p->backend) {
        pd_err_set(err, PD_ERR_INVALID, "xfer client: the nccl transport needs the decode pool's backend");
        return NULL;
    }
    pd_xfer_client *c = pd_calloc(1, sizeof *c);
    if (!c || !(c->secret = pd_strdup(p->secret))) {
        pd_free(c);
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->p = *p;
    c->p.secret = NULL;
    if (c->p.timeout_ms <= 0) c->p.timeout_ms = 30000;
    if (c->p.ping_ms <= 0) c->p.ping_ms = 500;
    if (c->p.max_inflight <= 0) c->p.max_inflight = 64;
    if (c->p.cancel_grace_ms <= 0) c->p.cancel_grace_ms = 10000;
    if (c->p.fence_ms <= 0) c->p.fence_ms = 2000;
    pthread_mutex_init(&c->qmu, NULL);
    if (c->p.on_enqueue) {
        if (pthread_create(&c->q_thread, NULL, queue_main, c)) {
            pd_free(c->secret);
            pd_free(c);
            pd_err_set(err, PD_ERR_IO, "cannot start the xfer queue thread");
            return NULL;
        }
        c->has_q_thread = true;
    }
    for (int i = 0; i < p->n_workers; i++) {
        worker *w = &c->workers[i];
        w->c = c;
        w->idx = i;
        w->peer_pidfd = -1;
        w->rtt_us = w->xfer_factor = w->compute_us_tok = w->remote_a_us = w->remote_b_us = -1;
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
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
    if (c->has_q_thread) pthread_join(c->q_thread, NULL);
    for (int i = 0; i < c->n_queue; i++) pd_free(c->queue[i].owned);
    pd_free(c->queue);
    c->queue = NULL;
    c->n_queue = 0;
    for (int i = 0; i < c->p.n_workers; i++) {
        worker *w = &c->workers[i];
        pthread_join(w->thread, NULL);
        for (int k = 0; k < w->n_inf; k++) pd_free(w->inf[k].dst_blocks);
        pd_free(w->inf);
        pd_free(w->discard);
        pd_buffer_free(w->staging);
        pthread_mutex_destroy(&w->mu);
    }
    pd_free(c->secret);
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

int pd_xfer_client_layers_landed(pd_xfer_client *c, uint64_t req_id) {
    int n = -1;
    for (int i = 0; i < c->p.n_workers && n < 0; i++) {
        worker *w = &c->workers[i];
        pthread_mutex_lock(&w->mu);
        for (int k = 0; k < w->n_inf; k++)
            if (w->inf[k].req_id == req_id) n = w->inf[k].n_landed;
        pthread_mutex_unlock(&w->mu);
    }
    return n;
}

pd_status pd_xfer_client_prefill(pd_xfer_client *c, const pd_kvw_prefill_req *req) {
    return pd_xfer_client_prefill_on(c, -1, req);
}

// Registers req on w and queues its PREFILL_REQ. PD_OK or PD_NOSPACE (w not connected) / NOMEM.
static pd_status send_to(pd_xfer_client *c, worker *best, const pd_kvw_prefill_req *req) {
    inflight f = {.req_id = req->req_id, .deadline_us = pd_time_us() + (int64_t)c->p.timeout_ms * 1000, .t_sent_us = pd_time_us(),
                  .start_pos = req->start_pos, .n_tokens = req->n_tokens, .n_dst_blocks = req->n_dst_blocks};
    f.dst_blocks = pd_malloc(sizeof(int32_t) * (size_t)(req->n_dst_blocks + 1));
    if (!f.dst_blocks) return PD_ERR_NOMEM;
    memcpy(f.dst_blocks, req->dst_blocks, sizeof(int32_t) * (size_t)req->n_dst_blocks);
    pd_kvw_msg m = {.type = PD_KVW_PREFILL_REQ};
    m.u.prefill_req = *req;
    pthread_mutex_lock(&best->mu);
    pd_status st = best->q_live && best->healthy ? PD_OK : PD_NOSPACE;
    if (st == PD_OK && PD_ARRAY_RESERVE(best->inf, best->cap_inf, (size_t)best->n_inf + 1)) st = PD_ERR_NOMEM;
    if (st == PD_OK) {
        best->inf[best->n_inf++] = f;  // registered before sending: the reply may race the send
        st = outq_push(&best->q, &m, NULL);  // queued only: the engine thread does no socket I/O
        if (st) take_inflight(best, req->req_id, NULL);
    } else {
        pd_free(f.dst_blocks);
    }
    pthread_mutex_unlock(&best->mu);
    return st == PD_OK ? PD_OK : PD_NOSPACE;
}

// Appends q to the queue of jobs waiting for a claim; false when out of memory.
static bool put_queued(pd_xfer_client *c, const queued *q) {
    pthread_mutex_lock(&c->qmu);
    bool ok = !PD_ARRAY_RESERVE(c->queue, c->cap_queue, (size_t)c->n_queue + 1);
    if (ok) c->queue[c->n_queue++] = *q;
    pthread_mutex_unlock(&c->qmu);
    return ok;
}

static pd_status enqueue(pd_xfer_client *c, const pd_kvw_prefill_req *req) {
    if (!c->p.on_enqueue) return PD_NOSPACE;
    size_t n = (size_t)req->n_tokens + (size_t)req->n_dst_blocks;
    queued q = {.req = *req, .deadline_us = pd_time_us() + (int64_t)c->p.timeout_ms * 1000};
    q.owned = pd_malloc(sizeof(int32_t) * (n + 1));
    if (!q.owned) return PD_NOSPACE;
    memcpy(q.owned, req->tokens, sizeof(int32_t) * (size_t)req->n_tokens);
    memcpy(q.owned + req->n_tokens, req->dst_blocks, sizeof(int32_t) * (size_t)req->n_dst_blocks);
    q.req.tokens = q.owned;
    q.req.dst_blocks = q.owned + req->n_tokens;
    if (!put_queued(c, &q)) {
        pd_free(q.owned);
        return PD_NOSPACE;
    }
    c->p.on_enqueue(c->p.enqueue_ud, req->req_id, req->n_tokens - req->start_pos);
    return PD_OK;
}

// Removes queued req_id (caller holds qmu); true with *out filled if it was there.
static bool take_queued(pd_xfer_client *c, uint64_t req_id, queued *out) {
    for (int i = 0; i < c->n_queue; i++)
        if (c->queue[i].req.req_id == req_id) {
            *out = c->queue[i];
            c->queue[i] = c->queue[--c->n_queue];
            return true;
        }
    return false;
}

pd_status pd_xfer_client_claim(pd_xfer_client *c, uint64_t req_id, const char *worker_addr) {
    worker *w = NULL;
    for (int i = 0; i < c->p.n_workers && !w; i++)
        if (!strcmp(c->workers[i].addr, worker_addr)) w = &c->workers[i];
    if (!w) return PD_ERR_INVALID;  // not a worker we dial: never sent anything
    queued q;
    pthread_mutex_lock(&c->qmu);
    bool had = take_queued(c, req_id, &q);
    pthread_mutex_unlock(&c->qmu);
    if (!had) return PD_ERR_NOTFOUND;
    pd_status st = send_to(c, w, &q.req);
    if (st != PD_OK) {  // back into the queue (another worker may claim it), unless OOM
        if (!put_queued(c, &q)) {
            pd_free(q.owned);
            emit_result(c, -1, req_id, PD_ERR_INVALID, "out of memory", NULL);
        }
        return PD_NOSPACE;
    }
    pd_free(q.owned);
    return PD_OK;
}

// Expires queued requests nobody claimed (nothing was written to their blocks: safe to reuse).
static void *queue_main(void *arg) {
    pd_xfer_client *c = arg;
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
        poll(NULL, 0, 50);
        int64_t now = pd_time_us();
        for (;;) {
            queued q;
            bool found = false;
            pthread_mutex_lock(&c->qmu);
            for (int i = 0; i < c->n_queue && !found; i++)
                if (c->queue[i].deadline_us < now) found = take_queued(c, c->queue[i].req.req_id, &q);
            pthread_mutex_unlock(&c->qmu);
            if (!found) break;
            pd_free(q.owned);
            emit_result(c, -1, q.req.req_id, PD_ERR_TIMEOUT, "no prefill worker claimed the queued job in time", NULL);
        }
    }
    return NULL;
}

pd_status pd_xfer_client_prefill_on(pd_xfer_client *c, int worker_idx, const pd_kvw_prefill_req *req) {
    for (int i = 0; i < req->n_dst_blocks; i++)
        if (req->dst_blocks[i] < 0 || req->dst_blocks[i] >= c->p.pool.n_blocks) return PD_ERR_INVALID;
    if (worker_idx == PD_XFER_QUEUE) return enqueue(c, req);
    // The chosen worker, else the least in-flight healthy one; a worker at max_inflight is saturated.
    worker *best = NULL;
    int best_n = 1 << 30;
    for (int i = 0; i < c->p.n_workers; i++) {
        if (worker_idx >= 0 && i != worker_idx) continue;
        worker *w = &c->workers[i];
        pthread_mutex_lock(&w->mu);
        if (w->healthy && w->n_inf < c->p.max_inflight && w->n_inf < best_n) {
            best = w;
            best_n = w->n_inf;
        }
        pthread_mutex_unlock(&w->mu);
    }
    if (!best) return PD_NOSPACE;
    return send_to(c, best, req);
}

void pd_xfer_client_cancel(pd_xfer_client *c, uint64_t req_id) {
    queued q;
    pthread_mutex_lock(&c->qmu);
    bool was_queued = take_queued(c, req_id, &q);
    pthread_mutex_unlock(&c->qmu);
    if (was_queued) {  // never sent: nobody writes its blocks
        pd_free(q.owned);
        emit_result(c, -1, req_id, PD_ERR_INVALID, "cancelled", NULL);
        return;
    }
    for (int i = 0; i < c->p.n_workers; i++) {
        worker *w = &c->workers[i];
        pthread_mutex_lock(&w->mu);
        bool had = false;  // (a timed-out request was cancelled already)
        for (int k = 0; k < w->n_inf && !had; k++) had = w->inf[k].req_id == req_id && !w->inf[k].timed_out;
        if (had && w->q_live) {
            pd_kvw_msg cm = {.type = PD_KVW_CANCEL};
            cm.u.cancel.req_id = req_id;
            outq_push(&w->q, &cm, NULL);
        }
        pthread_mutex_unlock(&w->mu);
    }
}

// ---- prefill side ------------------------------------------------------------------------------
#define SERVER_IDLE_MS 30000  // an authenticated peer silent this long (it pings every 500 ms) is dropped

typedef struct sconn {
    pd_xfer_server *s;  // borrowed
    int id, slot, fd;
    bool is_unix;
    pthread_t thread;
    outq q;
    int alive;           // atomic: 1 until the connection ends (direct writers check it per layer)
    bool done;           // the thread has finished (guarded by s->mu); the slot can be reaped
    // nccl transport
    pthread_mutex_t kv_mu;  // guards comm; held for a post or a (bounded) wait
    pd_comm *comm;          // rank 1 of this connection's communicator
} sconn;

struct pd_xfer_server {
    pd_xfer_server_params p;
    char *secret;
    int lfd, ufd, port;
    pthread_t accept_thread;
    pthread_mutex_t mu;  // guards slots, gen, sconn.done
    sconn *slots[PD_XFER_MAX_CONNS];
    uint32_t gen[PD_XFER_MAX_CONNS];
    pd_xfer_counters ctr;
    int stop;  // atomic
    float step_a_us, step_b_us;  // the prefill engine's step-time model (atomics via mu_model)
    uint32_t chunk_tokens;
    pthread_mutex_t mu_model;
};

void pd_xfer_server_counters(pd_xfer_server *s, pd_xfer_counters *out) { counters_get(&s->ctr, out); }

static void debug_pause(pd_xfer_server *s, const char *step) {
    if (!s->p.debug_pause || strcmp(s->p.debug_pause, step)) return;
    PD_LOG_W("xfer: debug: paused at %s", step);
    fprintf(stderr, "pdserve: debug: paused at %s\n", step);
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) poll(NULL, 0, 50);
}

// The first exchange: nothing else is read before a correct proof.
static bool server_auth(sconn *k, uint8_t **buf, size_t *cap) {
    pd_xfer_server *s = k->s;
    pd_kvw_msg ch = {.type = PD_KVW_AUTH_CHALLENGE}, m;
    pd_auth_nonce(ch.u.auth.nonce);
    pd_err err = {0};
    if (send_now(k->fd, &ch, -1)) return false;
    if (recv_frame(k->fd, buf, cap, &m, 1u << PD_KVW_AUTH_PROOF, PD_KVW_NONCE + PD_KVW_MAC,
                   pd_time_us() + AUTH_MS * 1000ll, NULL, &err)) {
        count(&s->ctr.auth_failures);
        return false;
    }
    uint8_t want[32];
    pd_auth_mac(s->secret, LABEL_CLIENT, ch.u.auth.nonce, m.u.auth.nonce, want);
    if (!pd_auth_mac_equal(want, m.u.auth.mac)) {
        count(&s->ctr.auth_failures);
        PD_LOG_W("xfer: a peer failed authentication on the KV port: disconnected");
        return false;
    }
    pd_kvw_msg ok = {.type = PD_KVW_AUTH_OK};
    pd_auth_mac(s->secret, LABEL_SERVER, m.u.auth.nonce, ch.u.auth.nonce, ok.u.auth.mac);
    return send_now(k->fd, &ok, -1) == PD_OK;
}

static void *sconn_main(void *arg) {
    sconn *k = arg;
    pd_xfer_server *s = k->s;
    uint8_t *buf = NULL;
    size_t cap = 0;
    pd_kvw_msg m;
    pd_err err = {0};
    bool hello_ok = false, announced = false, nccl = false;
    pd_comm_id cid;
    int got_fd = -1;
    pd_status hst = PD_ERR_CLOSED;
    if (server_auth(k, &buf, &cap)) {
        hst = recv_frame(k->fd, &buf, &cap, &m, 1u << PD_KVW_HELLO, pd_kvw_max_body(PD_KVW_HELLO),
                         pd_time_us() + AUTH_MS * 1000ll, &got_fd, &err);
        if (hst == PD_ERR_PROTO) {
            count(&s->ctr.proto_errors);
            PD_LOG_W("xfer: decode worker %d: %s: disconnected", k->id, err.msg);
        }
    }
    if (hst == PD_OK) {
        pd_kvw_msg ack = {.type = PD_KVW_HELLO_ACK};
        ack.u.hello_ack.fp = s->p.fp;
        const char *diff = pd_kvw_fingerprint_diff(&m.u.hello.fp, &s->p.fp);
        pd_kvw_transport tr = (pd_kvw_transport)m.u.hello.transport;
        nccl = tr == PD_KVW_TRANSPORT_NCCL;
        if (nccl && m.u.hello.handle_len == sizeof cid) memcpy(&cid, m.u.hello.handle, sizeof cid);
        const char *bad = NULL;
        if (*diff) bad = "model fingerprint mismatch";
        else if (tr < PD_KVW_TRANSPORT_TCP || tr > PD_KVW_TRANSPORT_UCX) bad = "unknown KV transport";
        else if (tr == PD_KVW_TRANSPORT_UCX && (!m.u.hello.handle_len || m.u.hello.handle_len > sizeof m.u.hello.handle))
            bad = "ucx: bad address/rkey";
        else if (tr == PD_KVW_TRANSPORT_SHM && (!k->is_unix || got_fd < 0))
            bad = "shm needs the unix socket and the pool's descriptor";
        else if (nccl && (!s->p.backend || m.u.hello.handle_len != sizeof cid))
            bad = s->p.backend ? "nccl: bad unique id" : "this prefill worker cannot use the nccl transport";
        else if ((tr == PD_KVW_TRANSPORT_SHM || tr == PD_KVW_TRANSPORT_CUDA_IPC) &&
                 m.u.hello.handle_len != sizeof(pd_buffer_handle))
            bad = "bad pool handle";
        if (bad) {
            snprintf(ack.u.hello_ack.error, sizeof ack.u.hello_ack.error, "%s%s%s", bad, *diff ? ": " : "", diff);
            PD_LOG_W("xfer: refusing a decode worker: %s", ack.u.hello_ack.error);
        } else {
            // The engine maps the decode pool (if any) before any request of this connection.
            pd_xfer_event ev = {.kind = PD_XFER_EV_HELLO, .conn_id = k->id, .hello = m.u.hello, .fd = got_fd};
            got_fd = -1;
            s->p.on_event(s->p.ud, &ev);
            pd_xfer_event_fini(&ev);  // (the callee took the fd if it kept it)
            ack.u.hello_ack.ok = 1;
            hello_ok = announced = true;
        }
        pd_kvw_msg_fini(&m);
        debug_pause(s, "hello_ack");
        if (send_now(k->fd, &ack, -1)) hello_ok = false;
    }
    if (got_fd >= 0) close(got_fd);
    if (hello_ok && nccl) {  // the decode worker joins as rank 0 after our HELLO_ACK
        pd_comm *cm = pd_comm_new(s->p.backend, &cid, 2, 1, NCCL_JOIN_MS, &err);
        if (!cm) PD_LOG_W("xfer: nccl bootstrap with decode worker %d failed: %s", k->id, err.msg);
        pthread_mutex_lock(&k->kv_mu);
        k->comm = cm;
        pthread_mutex_unlock(&k->kv_mu);
        hello_ok = cm != NULL;
    }
    if (hello_ok) hello_ok = outq_start(&k->q);
    int64_t last_rx = pd_time_us();
    while (hello_ok && !__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        uint32_t allow = 1u << PD_KVW_PING | 1u << PD_KVW_PREFILL_REQ | 1u << PD_KVW_CANCEL | 1u << PD_KVW_PROBE;
        pd_status st = recv_frame(k->fd, &buf, &cap, &m, allow, PD_KVW_MAX_BODY, pd_time_us() + 100000, NULL, &err);
        if (st == PD_ERR_TIMEOUT) {
            if (pd_time_us() - last_rx > SERVER_IDLE_MS * 1000ll) break;
            continue;
        }
        if (st) {
            if (st == PD_ERR_PROTO) {
                count(&s->ctr.proto_errors);
                PD_LOG_W("xfer: decode worker %d: %s: disconnected", k->id, err.msg);
            }
            break;
        }
        last_rx = pd_time_us();
        if (m.type == PD_KVW_PING) {
            pd_kvw_msg pong = {.type = PD_KVW_PONG};
            pong.u.ping.nonce = m.u.ping.nonce;
            outq_push(&k->q, &pong, NULL);
        } else if (m.type == PD_KVW_PROBE) {  // link probe: the same bytes a KV transfer would cross
            pd_kvw_msg pd = {.type = PD_KVW_PROBE_DATA};
            pd.u.probe = m.u.probe;
            pthread_mutex_lock(&s->mu_model);
            pd.u.probe.step_a_us = s->step_a_us, pd.u.probe.step_b_us = s->step_b_us;
            pd.u.probe.chunk_tokens = s->chunk_tokens;
            pthread_mutex_unlock(&s->mu_model);
            outq_push(&k->q, &pd, NULL);
        } else if (m.type == PD_KVW_PREFILL_REQ) {
            pd_xfer_event ev = {.kind = PD_XFER_EV_REQUEST, .conn_id = k->id, .req_id = m.u.prefill_req.req_id,
                                .req = m.u.prefill_req, .fd = -1};
            ev.owned = m.owned_i32;  // tokens + dst blocks move into the event
            m.owned_i32 = NULL;
            s->p.on_event(s->p.ud, &ev);
            pd_xfer_event_fini(&ev);
        } else if (m.type == PD_KVW_CANCEL) {
            pd_xfer_event ev = {.kind = PD_XFER_EV_CANCEL, .conn_id = k->id, .req_id = m.u.cancel.req_id, .fd = -1};
            s->p.on_event(s->p.ud, &ev);
        }
        pd_kvw_msg_fini(&m);
    }
    pd_free(buf);
    __atomic_store_n(&k->alive, 0, __ATOMIC_RELEASE);
    shutdown(k->fd, SHUT_RDWR);
    outq_stop(&k->q);  // drops what was queued
    pthread_mutex_lock(&k->kv_mu);  // waits for a wait in progress (bounded by its timeout)
    pd_comm_free(k->comm);          // aborts sends still in flight: their staging is free again
    k->comm = NULL;
    pthread_mutex_unlock(&k->kv_mu);
    if (announced) {
        pd_xfer_event ev = {.kind = PD_XFER_EV_CLOSED, .conn_id = k->id, .fd = -1};
        s->p.on_event(s->p.ud, &ev);
    }
    count(&s->ctr.conns_closed);
    pthread_mutex_lock(&s->mu);
    k->done = true;  // only now may the slot be reused (CLOSED is queued before any new HELLO)
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void sconn_free(sconn *k) {
    pthread_join(k->thread, NULL);
    outq_fini(&k->q);
    close(k->fd);
    pthread_mutex_destroy(&k->kv_mu);
    pd_free(k);
}

// Joins and frees finished connections (their slots become free). Accept thread only.
static void reap(pd_xfer_server *s) {
    sconn *dead[PD_XFER_MAX_CONNS];
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < PD_XFER_MAX_CONNS; i++)
        if (s->slots[i] && s->slots[i]->done) dead[n++] = s->slots[i], s->slots[i] = NULL;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) sconn_free(dead[i]);
}

static void accept_one(pd_xfer_server *s, int lfd, bool is_unix) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    if (!is_unix) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    reap(s);
    sconn *k = pd_calloc(1, sizeof *k);
    pthread_mutex_lock(&s->mu);
    int slot = -1;
    for (int i = 0; i < PD_XFER_MAX_CONNS && slot < 0 && k; i++)
        if (!s->slots[i]) slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&s->mu);
        PD_LOG_W("xfer: %d KV connections open: refusing another", PD_XFER_MAX_CONNS);
        close(fd);
        pd_free(k);
        return;
    }
    s->gen[slot] = (s->gen[slot] + 1) & 0x3fffff;
    k->s = s;
    k->fd = fd;
    k->slot = slot;
    k->id = (int)(slot | s->gen[slot] << 8);
    k->is_unix = is_unix;
    k->alive = 1;
    outq_init(&k->q, fd, s->p.max_queued_bytes, s->p.stall_ms, &s->ctr.slow_peer_drops);
    pthread_mutex_init(&k->kv_mu, NULL);
    s->slots[slot] = k;
    if (pthread_create(&k->thread, NULL, sconn_main, k)) {
        s->slots[slot] = NULL;
        pthread_mutex_unlock(&s->mu);
        outq_fini(&k->q);
        close(fd);
        pthread_mutex_destroy(&k->kv_mu);
        pd_free(k);
        return;
    }
    pthread_mutex_unlock(&s->mu);
    count(&s->ctr.conns_accepted);
}

static void *accept_main(void *arg) {
    pd_xfer_server *s = arg;
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        struct pollfd pfd[2] = {{.fd = s->lfd, .events = POLLIN}, {.fd = s->ufd, .events = POLLIN}};
        int n = poll(pfd, s->ufd >= 0 ? 2 : 1, 100);
        if (n <= 0) {
            reap(s);
            continue;
        }
        if (pfd[0].revents & POLLIN) accept_one(s, s->lfd, false);
        if (s->ufd >= 0 && (pfd[1].revents & POLLIN)) accept_one(s, s->ufd, true);
    }
    return NULL;
}

pd_xfer_server *pd_xfer_server_new(const pd_xfer_server_params *p, pd_err *err) {
    if (!p->secret || strlen(p->secret) < PD_AUTH_MIN_LEN) {
        pd_err_set(err, PD_ERR_INVALID, "the KV port needs a shared secret (--auth-token-file)");
        return NULL;
    }
    pd_xfer_server *s = pd_calloc(1, sizeof *s);
    if (!s || !(s->secret = pd_strdup(p->secret))) {
        pd_free(s);
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->p = *p;
    s->p.secret = NULL;
    if (!s->p.max_queued_bytes) s->p.max_queued_bytes = (size_t)1 << 30;
    if (s->p.stall_ms <= 0) s->p.stall_ms = 10000;
    s->lfd = s->ufd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->mu_model, NULL);
    s->step_a_us = s->step_b_us = -1;
    const char *host = p->host && *p->host ? p->host : "127.0.0.1";
    char port[16];
    snprintf(port, sizeof port, "%d", p->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) || !res) {
        pd_err_set(err, PD_ERR_INVALID, "xfer: cannot resolve %s", host);
        goto fail;
    }
    s->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int one = 1;
    if (s->lfd >= 0) setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
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
    // shm peers (same host) connect over the abstract unix socket of this port: it carries the
    // pool's descriptor. Authentication is the same; a squatter on the name only makes shm
    // unavailable (its peers cannot authenticate it).
    s->ufd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un ua;
    socklen_t ul;
    abstract_addr(s->port, &ua, &ul);
    if (s->ufd >= 0 && (bind(s->ufd, (struct sockaddr *)&ua, ul) || listen(s->ufd, 64))) {
        PD_LOG_W("xfer: cannot listen on the abstract unix socket @%s: %s (shm peers cannot connect)", ua.sun_path + 1,
                 strerror(errno));
        close(s->ufd);
        s->ufd = -1;
    }
    if (pthread_create(&s->accept_thread, NULL, accept_main, s)) {
        pd_err_set(err, PD_ERR_IO, "xfer: cannot start the accept thread");
        goto fail;
    }
    return s;
fail:
    if (s->lfd >= 0) close(s->lfd);
    if (s->ufd >= 0) close(s->ufd);
    pthread_mutex_destroy(&s->mu);
    pd_free(s->secret);
    pd_free(s);
    return NULL;
}

int pd_xfer_server_port(const pd_xfer_server *s) { return s->port; }

void pd_xfer_server_free(pd_xfer_server *s) {
    if (!s) return;
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    pthread_join(s->accept_thread, NULL);
    for (int i = 0; i < PD_XFER_MAX_CONNS; i++) {
        sconn *k = s->slots[i];
        if (!k) continue;
        shutdown(k->fd, SHUT_RDWR);
        sconn_free(k);
    }
    close(s->lfd);
    if (s->ufd >= 0) close(s->ufd);
    pthread_mutex_destroy(&s->mu);
    pd_free(s->secret);
    pd_free(s);
}

// The live connection with this id, or NULL; caller holds s->mu.
static sconn *conn_get(pd_xfer_server *s, int conn_id) {
    if (conn_id < 0) return NULL;
    sconn *k = s->slots[PD_XFER_CONN_SLOT(conn_id)];
    return k && k->id == conn_id && __atomic_load_n(&k->alive, __ATOMIC_ACQUIRE) ? k : NULL;
}

bool pd_xfer_server_conn_alive(pd_xfer_server *s, int conn_id) {
    pthread_mutex_lock(&s->mu);
    bool ok = conn_get(s, conn_id) != NULL;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

pd_status pd_xfer_server_send(pd_xfer_server *s, int conn_id, const pd_kvw_msg *m, void *payload) {
    pthread_mutex_lock(&s->mu);  // keeps k alive; outq_push never blocks on I/O
    sconn *k = conn_get(s, conn_id);
    pd_status st = k ? outq_push(&k->q, m, payload) : PD_ERR_CLOSED;
    pthread_mutex_unlock(&s->mu);
    if (!k) pd_free(payload);
    return st;
}

// Locks the connection's communicator (kv_mu): the connection cannot be freed while it is held.
static sconn *nccl_conn_lock(pd_xfer_server *s, int conn_id, pd_err *err) {
    pthread_mutex_lock(&s->mu);
    sconn *k = conn_get(s, conn_id);
    if (k) pthread_mutex_lock(&k->kv_mu);
    pthread_mutex_unlock(&s->mu);
    if (!k) pd_err_set(err, PD_ERR_CLOSED, "no decode worker %d", conn_id);
    else if (!k->comm) {
        pthread_mutex_unlock(&k->kv_mu);
        pd_err_set(err, PD_ERR_CLOSED, "decode worker %d has no communicator", conn_id);
        return NULL;
    }
    return k;
}

pd_status pd_xfer_server_nccl_post(pd_xfer_server *s, int conn_id, const pd_kvw_kv_nccl *hdr, const void *dev,
                                   pd_err *err) {
    sconn *k = nccl_conn_lock(s, conn_id, err);
    if (!k) return PD_ERR_CLOSED;
    pd_kvw_msg m = {.type = PD_KVW_KV_NCCL};
    m.u.kv_nccl = *hdr;
    pd_status st = outq_push(&k->q, &m, NULL);  // the announcement, then the send: same order on both
    if (st) {
        pd_err_set(err, st, "decode worker %d is gone", conn_id);
    } else {
        st = pd_comm_send_after_xfer(k->comm, dev, (size_t)hdr->bytes, 0, err);
        if (st) shutdown(k->fd, SHUT_RDWR);  // the communicator is aborted: end the connection
    }
    pthread_mutex_unlock(&k->kv_mu);
    return st;
}

pd_status pd_xfer_server_nccl_wait(pd_xfer_server *s, int conn_id, int timeout_ms, pd_err *err) {
    sconn *k = nccl_conn_lock(s, conn_id, err);
    if (!k) return PD_ERR_CLOSED;
    pd_status st = pd_comm_wait(k->comm, timeout_ms, err);
    if (st) shutdown(k->fd, SHUT_RDWR);  // the communicator is aborted: end the connection
    pthread_mutex_unlock(&k->kv_mu);
    return st;
}

int pd_xfer_client_links(pd_xfer_client *c, pd_link_stats *out, int max) {
    int n = 0;
    for (int i = 0; i < c->p.n_workers && n < max; i++) {
        worker *w = &c->workers[i];
        pd_link_stats *l = &out[n++];
        memset(l, 0, sizeof *l);
        snprintf(l->peer, sizeof l->peer, "%s", w->addr);
        pthread_mutex_lock(&w->mu);
        l->is_healthy = w->healthy;
        l->rtt_us = w->rtt_us;
        double a, b;
        bool fit = pd_link_fit_get(&w->xfer_fit, &a, &b);
        l->bw_bytes_per_s = fit && b > 0 ? 1e6 / b : -1;
        // Too fast for the probe sizes to tell (the slope is lost in the noise): their average
        // throughput, a lower bound.
        if (l->bw_bytes_per_s < 0 && w->xfer_fit.n > 0 && w->xfer_fit.sy > 0) l->bw_bytes_per_s = w->xfer_fit.sx / w->xfer_fit.sy * 1e6;
        if (l->bw_bytes_per_s > 0 && l->rtt_us < 0) l->rtt_us = a;
        l->remote_a_us = l->remote_b_us = -1;
        // The worker's own step-time model (sent with each probe answer); else what its compute
        // per prompt token was in the real transfers (which counts batch-mates' work too).
        if (w->remote_a_us >= 0 && w->remote_b_us >= 0) {
            l->remote_a_us = w->remote_a_us, l->remote_b_us = w->remote_b_us, l->remote_chunk = (int32_t)w->remote_chunk;
        } else if (w->compute_us_tok >= 0) {
            l->remote_a_us = 0, l->remote_b_us = w->compute_us_tok;
        }
        l->xfer_factor = w->xfer_factor;
        // Our prefill work queued there: every in-flight request's predicted compute (unknown
        // compute model: tokens are summed and priced by the caller's fallback, here 0).
        double q = 0;
        for (int k = 0; k < w->n_inf; k++)
            if (l->remote_b_us >= 0) q += l->remote_a_us + l->remote_b_us * (w->inf[k].n_tokens - w->inf[k].start_pos);
        (void)0;
        l->queue_us = q;
        l->n_probes = w->n_probes;
        l->n_transfers = w->n_transfers;
        pthread_mutex_unlock(&w->mu);
    }
    return n;
}

void pd_xfer_server_set_step_model(pd_xfer_server *s, double a_us, double b_us, int chunk_tokens) {
    pthread_mutex_lock(&s->mu_model);
    s->step_a_us = (float)a_us, s->step_b_us = (float)b_us;
    s->chunk_tokens = chunk_tokens > 0 ? (uint32_t)chunk_tokens : 0;
    pthread_mutex_unlock(&s->mu_model);
}
