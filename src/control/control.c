// control.c — the NATS connection, its inbox and the JetStream work queue (see control.h).
#include "control/control.h"
#include "control/nkey.h"

#include <nats/nats.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_SUBS 8

static int n_live;  // atomic: pd_ctl objects alive; the last one out releases libnats' global state

struct pd_ctl {
    natsConnection *nc;
    natsOptions *opts;
    natsSubscription *subs[MAX_SUBS];
    int n_subs;
    int efd;                   // eventfd: inbox not empty
    pthread_mutex_t mu;        // guards head/tail
    pd_ctl_msg *head, *tail;
    size_t inbox_bytes, inbox_n;  // backlog (guarded by mu)
    char *sign_key;            // the shared secret (pd_malloc'd)
    char *seed_file;           // the nkey seed file (pd_malloc'd), read at each signing; or NULL
    EVP_MAC *hmac;             // fetched once at connect (thread-safe to share; a context per MAC)
    int connected;             // atomic
    pd_ctl_stats st;           // atomics
    pthread_cond_t closed_cv;  // libnats' closed callback came (guarded by mu): the last callback
    bool is_closed;
};

static void bump(int64_t *v) { __atomic_add_fetch(v, 1, __ATOMIC_RELAXED); }

// Pd-Mac: hex HMAC-SHA256(key, "pdctl1" NUL subject NUL payload).
static bool mac_hex(EVP_MAC *hmac, const char *key, const char *subject, const void *data, int len, char out[65]) {
    uint8_t mac[32];
    size_t n = 0;
    bool ok = false;
    EVP_MAC_CTX *h = hmac ? EVP_MAC_CTX_new(hmac) : NULL;
    OSSL_PARAM prm[] = {OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0), OSSL_PARAM_construct_end()};
    if (h && EVP_MAC_init(h, (const uint8_t *)key, strlen(key), prm) == 1 &&
        EVP_MAC_update(h, (const uint8_t *)"pdctl1", 7) == 1 &&
        EVP_MAC_update(h, (const uint8_t *)subject, strlen(subject) + 1) == 1 &&
        (len <= 0 || EVP_MAC_update(h, data, (size_t)len) == 1) && EVP_MAC_final(h, mac, &n, sizeof mac) == 1 && n == 32)
        ok = true;
    EVP_MAC_CTX_free(h);
    for (int i = 0; ok && i < 32; i++) snprintf(out + 2 * i, 3, "%02x", mac[i]);
    return ok;
}

// Whether m (as received) carries a valid Pd-Mac for its subject and payload.
static bool msg_verify(pd_ctl *c, natsMsg *m) {
    const char *got = NULL;
    if (natsMsgHeader_Get(m, PD_CTL_MAC_HEADER, &got) != NATS_OK || !got || strlen(got) != 64) return false;
    char want[65];
    if (!mac_hex(c->hmac, c->sign_key, natsMsg_GetSubject(m), natsMsg_GetData(m), natsMsg_GetDataLength(m), want))
        return false;
    return CRYPTO_memcmp(want, got, 64) == 0;
}

// A message to publish, signed. NULL on failure.
static natsMsg *signed_msg(pd_ctl *c, const char *subject, const char *reply, const void *data, int len) {
    natsMsg *m = NULL;
    char mac[65];
    if (!mac_hex(c->hmac, c->sign_key, subject, data, len, mac)) return NULL;
    if (natsMsg_Create(&m, subject, reply, data, len) != NATS_OK) return NULL;
    if (natsMsgHeader_Set(m, PD_CTL_MAC_HEADER, mac) != NATS_OK) {
        natsMsg_Destroy(m);
        return NULL;
    }
    return m;
}

void pd_ctl_msg_free(pd_ctl_msg *m) {
    while (m) {
        pd_ctl_msg *n = m->next;
        pd_free(m->subject);
        pd_free(m->reply);
        pd_free(m->data);
        pd_free(m);
        m = n;
    }
}

// Any thread (libnats delivery and connection-event threads).
static void inbox_push(pd_ctl *c, const char *subject, const char *reply, const char *data, int len) {
    if (len < 0 || (unsigned)len > PD_CTL_MAX_MSG) {
        bump(&c->st.dropped);
        return;
    }
    pd_ctl_msg *m = pd_calloc(1, sizeof *m);
    if (m) {
        m->subject = pd_strdup(subject);
        m->reply = reply ? pd_strdup(reply) : NULL;
        m->data = pd_malloc((size_t)len + 1);
        m->len = len;
    }
    if (!m || !m->subject || !m->data || (reply && !m->reply)) {
        pd_ctl_msg_free(m);
        bump(&c->st.dropped);
        return;
    }
    if (len) memcpy(m->data, data, (size_t)len);
    m->data[len] = 0;
    pthread_mutex_lock(&c->mu);
    bool full = c->inbox_n >= PD_CTL_INBOX_MAX_MSGS || c->inbox_bytes + (size_t)len > PD_CTL_INBOX_MAX_BYTES;
    if (!full) {
        if (c->tail) c->tail->next = m;
        else c->head = m;
        c->tail = m;
        c->inbox_n++;
        c->inbox_bytes += (size_t)len;
    }
    pthread_mutex_unlock(&c->mu);
    if (full) {  // a flood faster than the consumer drains: drop the newest (counted)
        pd_ctl_msg_free(m);
        bump(&c->st.inbox_full);
        return;
    }
    bump(&c->st.received);
    uint64_t one = 1;
    ssize_t w = write(c->efd, &one, sizeof one);
    (void)w;
}

static void on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure) {
    (void)nc, (void)sub;
    pd_ctl *c = closure;
    if (natsMsg_GetDataLength(msg) > (int)PD_CTL_MAX_MSG) bump(&c->st.dropped);  // (not worth a MAC)
    else if (!msg_verify(c, msg)) bump(&c->st.bad_mac);
    else inbox_push(c, natsMsg_GetSubject(msg), natsMsg_GetReply(msg), natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
}

static void on_disconnected(natsConnection *nc, void *closure) {
    (void)nc;
    pd_ctl *c = closure;
    if (__atomic_exchange_n(&c->connected, 0, __ATOMIC_ACQ_REL)) {
        bump(&c->st.disconnects);
        PD_LOG_W("control: NATS connection lost; reconnecting (routing continues on the last known state)");
        inbox_push(c, PD_CTL_SUBJ_CONN, NULL, "down", 4);
    }
}

// The last callback libnats makes for a connection (after any disconnected one, on the same
// callback thread): only then may pd_ctl_free release what the callbacks use.
static void on_closed(natsConnection *nc, void *closure) {
    (void)nc;
    pd_ctl *c = closure;
    pthread_mutex_lock(&c->mu);
    c->is_closed = true;
    pthread_cond_broadcast(&c->closed_cv);
    pthread_mutex_unlock(&c->mu);
}

static void on_reconnected(natsConnection *nc, void *closure) {
    (void)nc;
    pd_ctl *c = closure;
    if (!__atomic_exchange_n(&c->connected, 1, __ATOMIC_ACQ_REL)) {
        bump(&c->st.reconnects);
        PD_LOG_I("control: NATS connection re-established");
        inbox_push(c, PD_CTL_SUBJ_CONN, NULL, "up", 2);
    }
}

// The nonce signer of an nkey connection (libnats calls it, unlocked, on every connect and
// reconnect, with the nonce from the server's INFO). pdserve signs itself rather than through
// natsOptions_SetNKeyFromSeed because of a libnats bug: its base64 encoder (3.4.1, Debian 12's
// libnats3.4; nats_Base64RawURL_EncodeString) takes a source whose FIRST BYTE is 0 for an empty
// string and encodes it as nothing, so CONNECT goes without "sig" and nats-server answers
// "Authorization Violation" ("Signature missing" in its debug log). An ed25519 signature begins
// with 0x00 for 1 nonce in 256: a router or worker with an nkey failed to start 1 time in 256 (and a
// reconnect failed as often). Such a signature is never handed to libnats: this attempt fails here
// (counted), no CONNECT is sent, and pd_ctl_connect / libnats' reconnect loop try again on a new
// TCP connection, whose new nonce's signature begins with 0x00 again only 1 time in 256.
// The seed is read from its file for each signature and wiped at once (as libnats did).
static natsStatus sign_nonce(char **err_txt, unsigned char **sig, int *sig_len, const char *nonce, void *closure) {
    pd_ctl *c = closure;
    char seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1];
    uint8_t raw[PD_NKEY_SIG_LEN];
    pd_err e = {0};
    pd_status st = pd_nkey_read_seed_file(c->seed_file, seed, pub, &e);
    if (st == PD_OK) st = pd_nkey_sign(seed, nonce, nonce ? strlen(nonce) : 0, raw, &e);
    OPENSSL_cleanse(seed, sizeof seed);
    *sig = NULL;
    *sig_len = 0;
    const char *why = st != PD_OK ? e.msg : raw[0] == 0 ? "the nonce's signature begins with a zero byte, which "
                                                          "libnats would drop: retrying with a new nonce" : NULL;
    if (why) {
        if (st == PD_OK) {
            bump(&c->st.nkey_zero_sigs);
            PD_LOG_I("control: the NATS nonce's signature begins with 0x00 (libnats would send it as nothing): "
                     "retrying on a new connection");
        }
        OPENSSL_cleanse(raw, sizeof raw);
        *err_txt = strdup(why);  // libnats frees it (libc free)
        return NATS_ERR;
    }
    *sig = malloc(PD_NKEY_SIG_LEN);  // libnats frees it (libc free)
    if (*sig) memcpy(*sig, raw, PD_NKEY_SIG_LEN);
    OPENSSL_cleanse(raw, sizeof raw);
    if (!*sig) return NATS_NO_MEMORY;
    *sig_len = PD_NKEY_SIG_LEN;
    return NATS_OK;
}

pd_ctl *pd_ctl_connect(const pd_ctl_params *p, pd_err *err) {
    if (!p->url || strncmp(p->url, "nats://", 7)) {
        pd_err_set(err, PD_ERR_INVALID, "--control must be nats://HOST:PORT (got '%s')", p->url ? p->url : "");
        return NULL;
    }
    if (!p->sign_key || !*p->sign_key || ((!p->token || !*p->token) && !p->nkey_seed_file)) {
        pd_err_set(err, PD_ERR_INVALID, "the NATS control plane authenticates: --control needs --auth-token-file");
        return NULL;
    }
    char seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1];
    if (p->nkey_seed_file && pd_nkey_read_seed_file(p->nkey_seed_file, seed, pub, err) != PD_OK) return NULL;
    OPENSSL_cleanse(seed, sizeof seed);  // (sign_nonce reads the file again, when it signs)
    pd_ctl *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->closed_cv, NULL);
    c->sign_key = pd_strdup(p->sign_key);
    c->seed_file = p->nkey_seed_file ? pd_strdup(p->nkey_seed_file) : NULL;
    c->hmac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    natsStatus s = c->efd < 0 || !c->sign_key || !c->hmac || (p->nkey_seed_file && !c->seed_file)
                       ? NATS_SYS_ERROR : natsOptions_Create(&c->opts);
    if (s == NATS_OK) s = natsOptions_SetServers(c->opts, (const char *[]){p->url}, 1);
    if (s == NATS_OK && p->nkey_seed_file) s = natsOptions_SetNKey(c->opts, pub, sign_nonce, c);
    else if (s == NATS_OK) s = natsOptions_SetToken(c->opts, p->token);
    if (s == NATS_OK && p->name) s = natsOptions_SetName(c->opts, p->name);
    if (s == NATS_OK) s = natsOptions_SetTimeout(c->opts, p->connect_timeout_ms > 0 ? p->connect_timeout_ms : 2000);
    if (s == NATS_OK) s = natsOptions_SetAllowReconnect(c->opts, true);
    if (s == NATS_OK) s = natsOptions_SetMaxReconnect(c->opts, -1);  // forever
    if (s == NATS_OK) s = natsOptions_SetReconnectWait(c->opts, p->reconnect_wait_ms > 0 ? p->reconnect_wait_ms : 250);
    if (s == NATS_OK) s = natsOptions_SetReconnectBufSize(c->opts, 8 << 20);
    if (s == NATS_OK) s = natsOptions_SetPingInterval(c->opts, 1000);
    if (s == NATS_OK) s = natsOptions_SetMaxPingsOut(c->opts, 2);
    if (s == NATS_OK) s = natsOptions_SetDisconnectedCB(c->opts, on_disconnected, c);
    if (s == NATS_OK) s = natsOptions_SetReconnectedCB(c->opts, on_reconnected, c);
    if (s == NATS_OK) s = natsOptions_SetClosedCB(c->opts, on_closed, c);
    // An attempt sign_nonce abandoned (a signature libnats would drop, see there) is tried again on
    // a new connection: 16 in a row have the odds 2^-128; any other failure is final.
    for (int attempt = 0; s == NATS_OK; attempt++) {
        int64_t z0 = __atomic_load_n(&c->st.nkey_zero_sigs, __ATOMIC_RELAXED);
        s = natsConnection_Connect(&c->nc, c->opts);
        if (s == NATS_OK || attempt == 15 || __atomic_load_n(&c->st.nkey_zero_sigs, __ATOMIC_RELAXED) == z0) break;
        s = NATS_OK;
    }
    if (s != NATS_OK) {
        natsStatus ls;
        const char *detail = nats_GetLastError(&ls);
        pd_err_set(err, s == NATS_CONNECTION_AUTH_FAILED || s == NATS_NOT_PERMITTED ? PD_ERR_INVALID : PD_ERR_IO,
                   "NATS %s: %s%s%s", p->url, natsStatus_GetText(s), detail ? ": " : "", detail ? detail : "");
        pd_ctl_free(c);
        return NULL;
    }
    c->connected = 1;
    __atomic_add_fetch(&n_live, 1, __ATOMIC_ACQ_REL);
    PD_LOG_I("control: connected to NATS %s (%s)", p->url, p->nkey_seed_file ? "nkey" : "token");
    return c;
}

void pd_ctl_free(pd_ctl *c) {
    if (!c) return;
    for (int i = 0; i < c->n_subs; i++) {
        natsSubscription_Unsubscribe(c->subs[i]);
        natsSubscription_Destroy(c->subs[i]);
    }
    bool callbacks_done = true;
    if (c->nc) {
        natsConnection_FlushTimeout(c->nc, 500);
        natsConnection_Close(c->nc);
        // libnats calls the disconnected and closed callbacks asynchronously after Close: wait
        // for the closed one (the last) before freeing what they touch (bounded: 3 s).
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += 3;
        pthread_mutex_lock(&c->mu);
        while (!c->is_closed && pthread_cond_timedwait(&c->closed_cv, &c->mu, &dl) == 0) {}
        callbacks_done = c->is_closed;
        pthread_mutex_unlock(&c->mu);
        natsConnection_Destroy(c->nc);
    }
    if (!callbacks_done) {  // never seen: leave c to a late callback rather than free it under one
        PD_LOG_W("control: NATS did not confirm the close in 3 s");
        return;
    }
    natsOptions_Destroy(c->opts);
    pd_ctl_msg_free(c->head);
    if (c->sign_key) OPENSSL_cleanse(c->sign_key, strlen(c->sign_key));
    pd_free(c->sign_key);
    pd_free(c->seed_file);
    EVP_MAC_free(c->hmac);
    if (c->efd >= 0) close(c->efd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->closed_cv);
    bool was_live = c->connected || c->st.disconnects;
    pd_free(c);
    // libnats keeps library-wide threads and state until nats_Close (the leak checker would see
    // them at exit): released when the last connection goes (nats_Open runs again on next use).
    if (was_live && __atomic_sub_fetch(&n_live, 1, __ATOMIC_ACQ_REL) == 0) nats_CloseAndWait(1000);
}

bool pd_ctl_is_connected(pd_ctl *c) { return __atomic_load_n(&c->connected, __ATOMIC_ACQUIRE); }

void pd_ctl_stats_get(pd_ctl *c, pd_ctl_stats *out) {
    out->disconnects = __atomic_load_n(&c->st.disconnects, __ATOMIC_RELAXED);
    out->reconnects = __atomic_load_n(&c->st.reconnects, __ATOMIC_RELAXED);
    out->published = __atomic_load_n(&c->st.published, __ATOMIC_RELAXED);
    out->publish_failures = __atomic_load_n(&c->st.publish_failures, __ATOMIC_RELAXED);
    out->received = __atomic_load_n(&c->st.received, __ATOMIC_RELAXED);
    out->dropped = __atomic_load_n(&c->st.dropped, __ATOMIC_RELAXED);
    out->bad_mac = __atomic_load_n(&c->st.bad_mac, __ATOMIC_RELAXED);
    out->inbox_full = __atomic_load_n(&c->st.inbox_full, __ATOMIC_RELAXED);
    out->nkey_zero_sigs = __atomic_load_n(&c->st.nkey_zero_sigs, __ATOMIC_RELAXED);
}

pd_status pd_ctl_publish(pd_ctl *c, const char *subject, const char *reply, const void *data, int len) {
    natsMsg *m = signed_msg(c, subject, reply, data, len);
    natsStatus s = m ? natsConnection_PublishMsg(c->nc, m) : NATS_NO_MEMORY;
    natsMsg_Destroy(m);
    bump(s == NATS_OK ? &c->st.published : &c->st.publish_failures);
    return s == NATS_OK ? PD_OK : PD_ERR_IO;
}

pd_status pd_ctl_request(pd_ctl *c, const char *subject, const void *data, int len, int timeout_ms, char **reply) {
    *reply = NULL;
    natsMsg *m = NULL, *rq = signed_msg(c, subject, NULL, data, len);
    natsStatus s = rq ? natsConnection_RequestMsg(&m, c->nc, rq, timeout_ms) : NATS_NO_MEMORY;
    natsMsg_Destroy(rq);
    if (s != NATS_OK) {
        natsMsg_Destroy(m);
        return s == NATS_NO_RESPONDERS ? PD_ERR_NOTFOUND : s == NATS_TIMEOUT ? PD_ERR_TIMEOUT : PD_ERR_IO;
    }
    if (!msg_verify(c, m)) {  // an answer anyone could have sent (the reply inbox is no secret)
        bump(&c->st.bad_mac);
        natsMsg_Destroy(m);
        return PD_ERR_PROTO;
    }
    int n = natsMsg_GetDataLength(m);
    char *r = pd_malloc((size_t)n + 1);
    if (r) {
        if (n) memcpy(r, natsMsg_GetData(m), (size_t)n);
        r[n] = 0;
    }
    natsMsg_Destroy(m);
    *reply = r;
    return r ? PD_OK : PD_ERR_NOMEM;
}

pd_status pd_ctl_subscribe(pd_ctl *c, const char *subject, pd_err *err) {
    if (c->n_subs >= MAX_SUBS) return pd_err_set(err, PD_ERR_INVALID, "control: too many subscriptions");
    natsStatus s = natsConnection_Subscribe(&c->subs[c->n_subs], c->nc, subject, on_msg, c);
    if (s != NATS_OK) return pd_err_set(err, PD_ERR_IO, "NATS subscribe %s: %s", subject, natsStatus_GetText(s));
    // A slow consumer would lose presence messages: allow a large backlog (they are small).
    natsSubscription_SetPendingLimits(c->subs[c->n_subs], 65536, 256 << 20);
    c->n_subs++;
    natsConnection_FlushTimeout(c->nc, 2000);  // the subscription is active at the server on return
    return PD_OK;
}

int pd_ctl_inbox_fd(pd_ctl *c) { return c->efd; }

pd_ctl_msg *pd_ctl_inbox_take(pd_ctl *c) {
    uint64_t v;
    ssize_t r = read(c->efd, &v, sizeof v);
    (void)r;
    pthread_mutex_lock(&c->mu);
    pd_ctl_msg *m = c->head;
    c->head = c->tail = NULL;
    c->inbox_n = c->inbox_bytes = 0;
    pthread_mutex_unlock(&c->mu);
    return m;
}

// ---- JetStream work queue ------------------------------------------------------------------------
struct pd_ctl_jobq {
    pd_ctl *c;
    jsCtx *js;
    natsSubscription *sub;  // pull consumer (NULL for producers)
};

struct pd_ctl_job {
    natsMsg *m;
};

pd_ctl_jobq *pd_ctl_jobq_new(pd_ctl *c, bool is_consumer, int ack_wait_ms, int max_deliver, pd_err *err) {
    pd_ctl_jobq *q = pd_calloc(1, sizeof *q);
    if (!q) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    q->c = c;
    jsErrCode je = 0;
    natsStatus s = natsConnection_JetStream(&q->js, c->nc, NULL);
    jsStreamConfig sc;
    if (s == NATS_OK) s = jsStreamConfig_Init(&sc);
    if (s == NATS_OK) {
        sc.Name = PD_CTL_JOBS_STREAM;
        sc.Subjects = (const char *[]){PD_CTL_JOBS_SUBJECT};
        sc.SubjectsLen = 1;
        sc.Retention = js_WorkQueuePolicy;
        sc.Storage = js_FileStorage;
        s = js_AddStream(NULL, q->js, &sc, NULL, &je);
        if (s != NATS_OK && je == JSStreamNameExistErr) s = NATS_OK;  // another worker made it
        if (s != NATS_OK) {
            // (some servers answer "stream name already in use" without the code: check it exists)
            jsStreamInfo *si = NULL;
            if (js_GetStreamInfo(&si, q->js, PD_CTL_JOBS_STREAM, NULL, NULL) == NATS_OK) s = NATS_OK;
            jsStreamInfo_Destroy(si);
        }
    }
    if (s == NATS_OK && is_consumer) {
        jsSubOptions so;
        jsSubOptions_Init(&so);
        so.Config.AckPolicy = js_AckExplicit;
        so.Config.AckWait = (int64_t)(ack_wait_ms > 0 ? ack_wait_ms : 5000) * 1000000;
        so.Config.MaxDeliver = max_deliver > 0 ? max_deliver : 5;
        s = js_PullSubscribe(&q->sub, q->js, PD_CTL_JOBS_SUBJECT, "prefill", NULL, &so, &je);
    }
    if (s != NATS_OK) {
        natsStatus ls;
        const char *detail = nats_GetLastError(&ls);
        pd_err_set(err, PD_ERR_IO, "JetStream work queue: %s (code %d)%s%s (is nats-server running with -js?)",
                   natsStatus_GetText(s), (int)je, detail ? ": " : "", detail ? detail : "");
        pd_ctl_jobq_free(q);
        return NULL;
    }
    return q;
}

void pd_ctl_jobq_free(pd_ctl_jobq *q) {
    if (!q) return;
    if (q->sub) natsSubscription_Destroy(q->sub);  // not Unsubscribe: that would delete the durable
    jsCtx_Destroy(q->js);
    pd_free(q);
}

pd_status pd_ctl_jobq_push_async(pd_ctl_jobq *q, const void *data, int len) {
    natsMsg *m = signed_msg(q->c, PD_CTL_JOBS_SUBJECT, NULL, data, len);
    natsStatus s = m ? js_PublishMsgAsync(q->js, &m, NULL) : NATS_NO_MEMORY;  // (takes m on success)
    natsMsg_Destroy(m);
    return s == NATS_OK ? PD_OK : PD_ERR_IO;
}

pd_status pd_ctl_jobq_push(pd_ctl_jobq *q, const void *data, int len, pd_err *err) {
    jsErrCode je = 0;
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = 2000;
    natsMsg *m = signed_msg(q->c, PD_CTL_JOBS_SUBJECT, NULL, data, len);
    natsStatus s = m ? js_PublishMsg(NULL, q->js, m, &po, &je) : NATS_NO_MEMORY;
    natsMsg_Destroy(m);
    if (s != NATS_OK) return pd_err_set(err, PD_ERR_IO, "JetStream publish: %s (code %d)", natsStatus_GetText(s), (int)je);
    return PD_OK;
}

int pd_ctl_jobq_fetch(pd_ctl_jobq *q, pd_ctl_job **out, int n, int timeout_ms) {
    if (!q->sub || n <= 0) return 0;
    natsMsgList list = {0};
    jsErrCode je = 0;
    natsStatus s = natsSubscription_Fetch(&list, q->sub, n, timeout_ms, &je);
    if (s != NATS_OK) {
        if (s != NATS_TIMEOUT) poll(NULL, 0, PD_MIN(timeout_ms, 100));  // disconnected: do not spin
        natsMsgList_Destroy(&list);
        return 0;
    }
    int k = 0;
    for (int i = 0; i < list.Count; i++) {
        if (!msg_verify(q->c, list.Msgs[i])) {  // not from a pdserve worker: done with it, never handed out
            bump(&q->c->st.bad_mac);
            natsMsg_Ack(list.Msgs[i], NULL);
            continue;
        }
        pd_ctl_job *j = k < n ? pd_malloc(sizeof *j) : NULL;
        if (!j) continue;  // left unacked: redelivered after ack_wait
        j->m = list.Msgs[i];
        list.Msgs[i] = NULL;
        out[k++] = j;
    }
    natsMsgList_Destroy(&list);
    return k;
}

const char *pd_ctl_job_data(const pd_ctl_job *j, int *len) {
    *len = natsMsg_GetDataLength(j->m);
    return natsMsg_GetData(j->m);
}

int64_t pd_ctl_job_n_delivered(const pd_ctl_job *j) {
    jsMsgMetaData *md = NULL;
    int64_t n = 1;
    if (natsMsg_GetMetaData(&md, j->m) == NATS_OK && md) n = (int64_t)md->NumDelivered;
    jsMsgMetaData_Destroy(md);
    return n;
}

void pd_ctl_job_free(pd_ctl_job *j) {
    if (!j) return;
    natsMsg_Destroy(j->m);
    pd_free(j);
}

pd_status pd_ctl_job_ack(pd_ctl_job *j) {
    natsStatus s = natsMsg_Ack(j->m, NULL);
    pd_ctl_job_free(j);
    return s == NATS_OK ? PD_OK : PD_ERR_IO;
}

pd_status pd_ctl_job_nak(pd_ctl_job *j) {
    natsStatus s = natsMsg_Nak(j->m, NULL);
    pd_ctl_job_free(j);
    return s == NATS_OK ? PD_OK : PD_ERR_IO;
}

pd_status pd_ctl_job_progress(pd_ctl_job *j) { return natsMsg_InProgress(j->m, NULL) == NATS_OK ? PD_OK : PD_ERR_IO; }
