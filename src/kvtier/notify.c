// notify.c — what Redis removes by itself from the KV pool, heard through keyspace notifications.
//
// The Redis tier keeps no index of its own: capacity and eviction are the server's (maxmemory and
// its policy), so a page can vanish at any time. Routers price a worker's "redis" tier from the KV
// events the worker sends them; without this file those entries outlived the pages. Here one
// thread per Redis store holds a second connection (authenticated like the first), subscribed to
//
//     PSUBSCRIBE __keyspace@0__:pdkv:<fingerprint>:*
//
// so the server sends only our model's keys, each with the event that touched it. "evicted"
// (maxmemory), "expired" (a TTL someone set), "del" (DEL / UNLINK: a bad page we dropped, an
// operator's cleanup) and "rename_from" (moved away) mean the page is gone: the store's callback
// turns each into a "removed, tier redis" KV event. Every other event of our keys ("set", ...) is
// ignored silently; a message that is not a well-formed notification of ours (another key, a bad
// hash, another fingerprint, an oversized element or reply) is ignored and counted.
//
// Notifications are a server setting (notify-keyspace-events, off by default). We need K (keyspace
// channels) and e, x, g (evicted, expired, generic) — "A" covers x, e and g. At every connect the
// setting is read (CONFIG GET); if it lacks some of them, CONFIG SET is tried once per connection
// with the missing flags added to what is there (never removing anyone else's). A server that
// refuses CONFIG (a managed Redis, a renamed command) gets one clear warning in the log and a
// count; we subscribe anyway, in case notifications are on without CONFIG GET telling us.
//
// The connection is read with poll() + redisBufferRead (100 ms ticks, so stop is prompt); a
// partial reply that grows past 1 MiB, a read error or a closed socket drops the connection and
// it is retried with the same backoff as the store's (100 ms doubling to 5 s).
#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvtier/kvtier.h"

#define NOTIFY_TIMEOUT_MS 200
#define NOTIFY_MAX_PENDING (1u << 20)  // bytes of an unfinished reply before the connection is dropped

struct pd_kvt_notify {
    char *host, *secret;
    int port;
    uint64_t fp;
    pd_kvt_removed_fn fn;
    void *ud;
    pthread_t thread;
    atomic_bool stop;
    _Atomic int64_t evicted, expired, deleted, ignored, config_refused, subscribes, drops;
    bool warned;
};

// ---- parsing (pure) ---------------------------------------------------------------------------------
static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static bool parse_hex64(const char *s, uint64_t *out) {
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        int d = hexval(s[i]);
        if (d < 0) return false;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return true;
}

pd_kvt_notify_kind pd_kvt_notify_parse(const char *channel, size_t clen, const char *event, size_t elen,
                                       uint64_t fingerprint, pd_hash128 *hash) {
    static const char ks[] = "__keyspace@", mid[] = "__:pdkv:";
    if (!channel || !event || clen > PD_KVT_NOTIFY_MAX_CHANNEL || elen > 32) return PD_KVT_NOTIFY_BAD;
    size_t p = sizeof ks - 1;
    if (clen < p || memcmp(channel, ks, p)) return PD_KVT_NOTIFY_BAD;
    size_t d0 = p;
    while (p < clen && p - d0 < 6 && channel[p] >= '0' && channel[p] <= '9') p++;
    if (p == d0) return PD_KVT_NOTIFY_BAD;  // the database number
    // "__:pdkv:" FP(16) ":" HASH(32), nothing after
    if (clen - p != sizeof mid - 1 + 16 + 1 + 32 || memcmp(channel + p, mid, sizeof mid - 1)) return PD_KVT_NOTIFY_BAD;
    p += sizeof mid - 1;
    uint64_t fp, hi, lo;
    if (!parse_hex64(channel + p, &fp) || channel[p + 16] != ':' || !parse_hex64(channel + p + 17, &hi) ||
        !parse_hex64(channel + p + 33, &lo))
        return PD_KVT_NOTIFY_BAD;
    if (fp != fingerprint) return PD_KVT_NOTIFY_BAD;  // another model's key: not ours to report
    static const struct {
        const char *name;
        pd_kvt_notify_kind kind;
    } k_events[] = {{"evicted", PD_KVT_NOTIFY_EVICTED}, {"expired", PD_KVT_NOTIFY_EXPIRED},
                    {"del", PD_KVT_NOTIFY_DEL}, {"rename_from", PD_KVT_NOTIFY_DEL}};
    if (hash) *hash = (pd_hash128){.lo = lo, .hi = hi};
    for (size_t i = 0; i < sizeof k_events / sizeof k_events[0]; i++)
        if (elen == strlen(k_events[i].name) && !memcmp(event, k_events[i].name, elen)) return k_events[i].kind;
    return PD_KVT_NOTIFY_OTHER;
}

bool pd_kvt_notify_flags_ok(const char *flags) {
    if (!flags || !strchr(flags, 'K')) return false;
    if (strchr(flags, 'A')) return true;
    return strchr(flags, 'e') && strchr(flags, 'x') && strchr(flags, 'g');
}

void pd_kvt_notify_flags_merge(const char *flags, char *out, size_t n) {
    if (!n) return;
    snprintf(out, n, "%s", flags ? flags : "");
    const char *want = "Kexg";
    for (const char *w = want; *w; w++) {
        if (strchr(out, *w) || (*w != 'K' && strchr(out, 'A'))) continue;
        size_t l = strlen(out);
        if (l + 1 < n) out[l] = *w, out[l + 1] = 0;
    }
}

// ---- the connection ---------------------------------------------------------------------------------
static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static redisReply *cmd(redisContext *c, int argc, const char **argv) {
    size_t lens[4];
    for (int i = 0; i < argc; i++) lens[i] = strlen(argv[i]);
    redisReply *r = redisCommandArgv(c, argc, argv, lens);
    if (r && c->err) {
        freeReplyObject(r);
        return NULL;
    }
    return r;
}

// Reads notify-keyspace-events and adds what we need (once per connection). false: the
// connection broke (drop it); true otherwise, whatever the server allowed.
static bool ensure_config(pd_kvt_notify *n, redisContext *c) {
    const char *get[] = {"CONFIG", "GET", "notify-keyspace-events"};
    redisReply *r = cmd(c, 3, get);
    if (!r) return false;
    if (r->type == REDIS_REPLY_ERROR && (!strncmp(r->str, "NOAUTH", 6) || !strncmp(r->str, "WRONGPASS", 9))) {
        freeReplyObject(r);  // not let in (no or a wrong secret): not a CONFIG refusal; retried with backoff
        return false;
    }
    char cur[64] = "";
    bool known = r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r->element[1]->type == REDIS_REPLY_STRING &&
                 r->element[1]->len < sizeof cur;
    if (known) memcpy(cur, r->element[1]->str, r->element[1]->len), cur[r->element[1]->len] = 0;
    freeReplyObject(r);
    if (known && pd_kvt_notify_flags_ok(cur)) return true;
    char want[80];
    pd_kvt_notify_flags_merge(cur, want, sizeof want);
    const char *set[] = {"CONFIG", "SET", "notify-keyspace-events", want};
    r = cmd(c, 4, set);
    if (!r) return false;
    bool ok = r->type == REDIS_REPLY_STATUS;
    if (!ok) {
        atomic_fetch_add(&n->config_refused, 1);
        if (!n->warned)
            PD_LOG_W("kvtier: Redis %s:%d refused CONFIG SET notify-keyspace-events %s (%.*s): pages it evicts "
                     "itself (maxmemory) are not reported to routers until the server runs with "
                     "notify-keyspace-events including K, e, x and g (or KA)",
                     n->host, n->port, want, r->type == REDIS_REPLY_ERROR ? (int)PD_MIN(r->len, 200) : 2,
                     r->type == REDIS_REPLY_ERROR ? r->str : "?");
        n->warned = true;
    }
    freeReplyObject(r);
    return true;
}

static redisContext *sub_connect(pd_kvt_notify *n) {
    struct timeval tv = {0, NOTIFY_TIMEOUT_MS * 1000};
    redisContext *c = redisConnectWithTimeout(n->host, n->port, tv);
    if (!c || c->err || redisSetTimeout(c, tv) != REDIS_OK) goto fail;
    if (n->secret) {
        const char *auth[] = {"AUTH", n->secret};
        redisReply *r = cmd(c, 2, auth);
        bool ok = r && r->type == REDIS_REPLY_STATUS;
        if (r) freeReplyObject(r);
        if (!ok) goto fail;
    }
    if (!ensure_config(n, c)) goto fail;
    char pat[96];
    snprintf(pat, sizeof pat, "__keyspace@0__:pdkv:%016" PRIx64 ":*", n->fp);
    const char *ps[] = {"PSUBSCRIBE", pat};
    redisReply *r = cmd(c, 2, ps);
    bool ok = r && r->type == REDIS_REPLY_ARRAY && r->elements == 3 && r->element[0]->type == REDIS_REPLY_STRING &&
              !strcmp(r->element[0]->str, "psubscribe");
    if (r) freeReplyObject(r);
    if (!ok) goto fail;
    atomic_fetch_add(&n->subscribes, 1);
    return c;
fail:
    if (c) redisFree(c);
    return NULL;
}

// One reply off the subscribed connection.
static void handle(pd_kvt_notify *n, const redisReply *r) {
    if (r->type == REDIS_REPLY_ARRAY && r->elements >= 1 && r->element[0]->type == REDIS_REPLY_STRING &&
        (!strcmp(r->element[0]->str, "psubscribe") || !strcmp(r->element[0]->str, "pong")))
        return;
    bool shape = r->type == REDIS_REPLY_ARRAY && r->elements == 4;
    for (size_t i = 0; shape && i < 4; i++) shape = r->element[i]->type == REDIS_REPLY_STRING;
    if (!shape || strcmp(r->element[0]->str, "pmessage")) {
        atomic_fetch_add(&n->ignored, 1);
        return;
    }
    pd_hash128 h;
    pd_kvt_notify_kind k = pd_kvt_notify_parse(r->element[2]->str, r->element[2]->len, r->element[3]->str,
                                               r->element[3]->len, n->fp, &h);
    switch (k) {
    case PD_KVT_NOTIFY_BAD: atomic_fetch_add(&n->ignored, 1); return;
    case PD_KVT_NOTIFY_OTHER: return;
    case PD_KVT_NOTIFY_EVICTED: atomic_fetch_add(&n->evicted, 1); break;
    case PD_KVT_NOTIFY_EXPIRED: atomic_fetch_add(&n->expired, 1); break;
    case PD_KVT_NOTIFY_DEL: atomic_fetch_add(&n->deleted, 1); break;
    }
    n->fn(n->ud, h, k);
}

static void *notify_main(void *arg) {
    pd_kvt_notify *n = arg;
    redisContext *c = NULL;
    int64_t backoff = 0, retry_at = 0;
    while (!atomic_load(&n->stop)) {
        if (!c) {
            if (now_ms() < retry_at) {
                struct timespec ts = {0, 20 * 1000000};
                nanosleep(&ts, NULL);
                continue;
            }
            c = sub_connect(n);
            if (!c) {
                backoff = backoff ? PD_MIN(backoff * 2, 5000) : 100;
                retry_at = now_ms() + backoff;
                continue;
            }
            backoff = 0;
        }
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, 100);
        if (pr == 0 || (pr < 0 && errno == EINTR)) continue;
        bool drop = pr < 0 || redisBufferRead(c) != REDIS_OK;
        while (!drop) {
            void *rep = NULL;
            if (redisGetReplyFromReader(c, &rep) != REDIS_OK) {
                drop = true;
                break;
            }
            if (!rep) break;
            handle(n, rep);
            freeReplyObject(rep);
        }
        if (!drop && c->reader && c->reader->len - c->reader->pos > NOTIFY_MAX_PENDING) {
            atomic_fetch_add(&n->ignored, 1);  // a reply too large to be a notification of ours
            drop = true;
        }
        if (drop) {
            redisFree(c);
            c = NULL;
            atomic_fetch_add(&n->drops, 1);
            backoff = backoff ? PD_MIN(backoff * 2, 5000) : 100;
            retry_at = now_ms() + backoff;
        }
    }
    if (c) redisFree(c);
    return NULL;
}

pd_kvt_notify *pd_kvt_notify_start(const char *host, int port, const char *secret, uint64_t fingerprint,
                                   pd_kvt_removed_fn fn, void *ud, pd_err *err) {
    pd_kvt_notify *n = pd_calloc(1, sizeof *n);
    if (n) {
        n->host = pd_strdup(host);
        n->secret = secret ? pd_strdup(secret) : NULL;
    }
    if (!n || !n->host || (secret && !n->secret)) goto nomem;
    n->port = port;
    n->fp = fingerprint;
    n->fn = fn;
    n->ud = ud;
    atomic_init(&n->stop, false);
    if (pthread_create(&n->thread, NULL, notify_main, n)) goto nomem;
    return n;
nomem:
    if (n) pd_free(n->host), pd_free(n->secret);
    pd_free(n);
    pd_err_set(err, PD_ERR_NOMEM, "kvtier: cannot start the Redis notification thread");
    return NULL;
}

void pd_kvt_notify_stop(pd_kvt_notify *n) {
    if (!n) return;
    atomic_store(&n->stop, true);
    pthread_join(n->thread, NULL);
    pd_free(n->host);
    pd_free(n->secret);
    pd_free(n);
}

void pd_kvt_notify_stats_get(pd_kvt_notify *n, pd_kvt_notify_stats *out) {
    memset(out, 0, sizeof *out);
    if (!n) return;
    out->evicted = atomic_load(&n->evicted);
    out->expired = atomic_load(&n->expired);
    out->deleted = atomic_load(&n->deleted);
    out->ignored = atomic_load(&n->ignored);
    out->config_refused = atomic_load(&n->config_refused);
    out->subscribes = atomic_load(&n->subscribes);
    out->drops = atomic_load(&n->drops);
}
