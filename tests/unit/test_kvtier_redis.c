// test_kvtier_redis.c — the Redis tier against a real redis-server started here on a free loopback
// port (killed at the end): two stores (two workers) share pages, a corrupted value is a miss and
// is deleted, the server killed mid-run → gets miss and puts fail at once (counted), and once it is
// back the store reconnects by itself (backoff); the keyspace-notification subscriber against a real
// server and against a hostile fake one (garbage, foreign keys, an oversized reply, a close mid-message).
#include "test.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/hash.h"
#include "kvtier/kvtier.h"

static const pd_kvt_geom G = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .block_size = 4};

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    int port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static void stop_redis(pid_t pid) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static pid_t start_redis_args(int port, const char *const *extra) {
    pid_t pid = fork();
    if (pid == 0) {
        char ps[16];
        snprintf(ps, sizeof ps, "%d", port);
        const char *argv[24] = {"redis-server", "--port", ps, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"};
        int n = 9;
        for (int i = 0; extra && extra[i] && n < 23; i++) argv[n++] = extra[i];
        argv[n] = NULL;
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; pid > 0 && i < 200; i++) {  // bounded: 10 s
        struct timeval tv = {0, 100000};
        redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
        bool ok = false;
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "PING");
            ok = r && r->type == REDIS_REPLY_STATUS;
            if (r) freeReplyObject(r);
        }
        if (c) redisFree(c);
        if (ok) return pid;
        usleep(50000);
    }
    if (pid > 0) stop_redis(pid);
    return -1;
}

static pid_t start_redis(int port) { return start_redis_args(port, NULL); }

static uint8_t *mkpage(uint64_t fp, pd_hash128 h, float seed, size_t *n) {
    static float kk[2][4 * 16], vv[2][4 * 16];
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < 64; i++) {
            kk[l][i] = seed * (float)(i - 32) / 7.0f;
            vv[l][i] = seed + (float)l - (float)i / 64.0f;
        }
    const float *k[2] = {kk[0], kk[1]}, *v[2] = {vv[0], vv[1]};
    *n = pd_kvt_page_bytes(&G, PD_KVT_BF16);
    uint8_t *p = malloc(*n);
    pd_kvt_page_encode(&G, PD_KVT_BF16, fp, h, pd_hash_root(0), k, v, p, *n);
    return p;
}

PD_TEST(redis_pool_shared_corrupt_down_reconnect) {
    if (system("command -v redis-server >/dev/null 2>&1") != 0) PD_SKIP("redis-server not installed");
    int port = free_port();
    PD_REQUIRE(port > 0);
    pid_t pid = start_redis(port);
    PD_REQUIRE(pid > 0);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    pd_kvt_store_params sp = {.geom = G, .fingerprint = 0xabcdef, .capacity = 0};
    pd_err err = {0};
    pd_kvt_store *w1 = pd_kvt_redis_new(&sp, url, &err);
    pd_kvt_store *w2 = pd_kvt_redis_new(&sp, url, &err);
    pd_kvt_store_params other = sp;
    other.fingerprint = 0x123;
    pd_kvt_store *w3 = pd_kvt_redis_new(&other, url, &err);  // another model
    PD_REQUIRE(w1 && w2 && w3);
    PD_CHECK(pd_kvt_redis_new(&sp, "http://x:1", &err) == NULL);
    PD_CHECK(pd_kvt_redis_new(&sp, "redis://host:99999", &err) == NULL);

    size_t n;
    pd_hash128 h1 = {11, 12}, h2 = {21, 22};
    uint8_t *p1 = mkpage(0xabcdef, h1, 1.5f, &n), *p2 = mkpage(0xabcdef, h2, -2.0f, &n);
    uint8_t *buf = malloc(n);
    size_t got = 0;
    // Worker 1 computes, worker 2 reuses.
    PD_CHECK_EQ(pd_kvt_store_get(w2, h1, buf, n, &got), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_kvt_store_put(w1, h1, p1, n), PD_OK);
    PD_CHECK_EQ(pd_kvt_store_put(w1, h2, p2, n), PD_OK);
    PD_CHECK(pd_kvt_store_contains(w2, h1));
    PD_CHECK_EQ(pd_kvt_store_get(w2, h1, buf, n, &got), PD_OK);
    PD_CHECK(got == n && memcmp(buf, p1, n) == 0);
    PD_CHECK(!pd_kvt_store_contains(w3, h1));  // another model never sees it
    PD_CHECK_EQ(pd_kvt_store_get(w3, h1, buf, n, &got), PD_ERR_NOTFOUND);

    // Corrupt h2's value behind the store's back: a miss, counted, and the key is deleted.
    {
        struct timeval tv = {1, 0};
        redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
        PD_REQUIRE(c && !c->err);
        char key[96];
        snprintf(key, sizeof key, "pdkv:%016llx:%016llx%016llx", 0xabcdefull, 22ull, 21ull);
        uint8_t *bad = malloc(n);
        memcpy(bad, p2, n);
        bad[n / 2] ^= 1;
        redisReply *r = redisCommand(c, "SET %s %b", key, bad, n);
        PD_CHECK(r && r->type == REDIS_REPLY_STATUS);
        if (r) freeReplyObject(r);
        free(bad);
        PD_CHECK_EQ(pd_kvt_store_get(w2, h2, buf, n, &got), PD_ERR_NOTFOUND);
        r = redisCommand(c, "EXISTS %s", key);
        PD_CHECK(r && r->type == REDIS_REPLY_INTEGER && r->integer == 0);
        if (r) freeReplyObject(r);
        redisFree(c);
    }
    pd_kvt_store_stats st;
    pd_kvt_store_stats_get(w2, &st);
    PD_CHECK_EQ(st.bad_pages, 1);
    PD_CHECK_EQ(st.hits, 1);
    PD_CHECK_EQ(st.misses, 2);

    // Redis goes away mid-run: operations miss / fail (never hang past the timeout), counted.
    stop_redis(pid);
    PD_CHECK_EQ(pd_kvt_store_get(w1, h1, buf, n, &got), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_kvt_store_put(w1, h2, p2, n), PD_ERR_IO);
    for (int i = 0; i < 20; i++) PD_CHECK_EQ(pd_kvt_store_get(w1, h1, buf, n, &got), PD_ERR_NOTFOUND);
    PD_CHECK(pd_kvt_redis_down_misses(w1) >= 22);
    pd_kvt_store_stats_get(w1, &st);
    PD_CHECK_EQ(st.put_failures, 1);
    PD_CHECK_EQ(st.misses, 21);

    // Back on the same port: the store reconnects by itself (bounded wait: 15 s).
    pid = start_redis(port);
    PD_REQUIRE(pid > 0);
    bool back = false;
    for (int i = 0; i < 150 && !back; i++) {
        back = pd_kvt_store_put(w1, h1, p1, n) == PD_OK;
        if (!back) usleep(100000);
    }
    PD_CHECK(back);
    // Worker 2's old connection died with the server: its first call notices, then it comes back.
    bool got_it = false;
    for (int i = 0; i < 150 && !got_it; i++) {
        got_it = pd_kvt_store_get(w2, h1, buf, n, &got) == PD_OK;
        if (!got_it) usleep(100000);
    }
    PD_CHECK(got_it && memcmp(buf, p1, n) == 0);

    stop_redis(pid);
    pd_kvt_store_free(w1);
    pd_kvt_store_free(w2);
    pd_kvt_store_free(w3);
    free(p1);
    free(p2);
    free(buf);
}

static void on_loaded(void *ud, uint64_t req_id, int n_loaded, int64_t load_us) {
    (void)req_id;
    (void)load_us;
    *(int *)ud = n_loaded;
}

// Two workers (two tier chains: DRAM + the Redis pool): what worker 1 offloads, worker 2 finds by
// hash and loads (bf16 pages); with Redis killed, worker 2's load is a counted miss and returns.
PD_TEST(redis_two_workers_share_prefix_then_redis_dies) {
    if (system("command -v redis-server >/dev/null 2>&1") != 0) PD_SKIP("redis-server not installed");
    int port = free_port();
    PD_REQUIRE(port > 0);
    pid_t pid = start_redis(port);
    PD_REQUIRE(pid > 0);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    pd_err err = {0};
    pd_kvt_tiers *w[2];
    size_t f32b = pd_kvt_page_bytes(&G, PD_KVT_F32);
    for (int i = 0; i < 2; i++) {
        pd_kvt_store_params dp = {.geom = G, .fingerprint = 5, .capacity = f32b * 64, .policy = PD_KVT_S3FIFO};
        pd_kvt_tiers_params tp = {.geom = G, .fingerprint = 5, .dtype = PD_KVT_BF16, .n_stores = 2};
        tp.stores[0] = pd_kvt_dram_new(&dp, &err);
        tp.stores[1] = pd_kvt_redis_new(&dp, url, &err);
        PD_REQUIRE(tp.stores[0] && tp.stores[1]);
        w[i] = pd_kvt_tiers_new(&tp, &err);
        PD_REQUIRE(w[i]);
    }
    enum { NB = 4 };
    static float data[NB][2][2][64], out[NB][2][2][64];
    pd_hash128 hs[NB], parent = pd_hash_root(0);
    for (int b = 0; b < NB; b++) {
        int32_t toks[4] = {7 * b, 1, 2, 3};
        hs[b] = pd_hash_block(&parent, toks, 4);
        for (int l = 0; l < 2; l++)
            for (int i = 0; i < 64; i++) {
                data[b][l][0][i] = (float)(b + 1) * (float)(i % 9 - 4) / 3.0f;
                data[b][l][1][i] = (float)(l - b) + (float)i / 50.0f;
            }
        const float *k[2] = {data[b][0][0], data[b][1][0]}, *v[2] = {data[b][0][1], data[b][1][1]};
        PD_CHECK_EQ(pd_kvt_tiers_offload(w[0], hs[b], parent, k, v), PD_OK);
        parent = hs[b];
    }
    PD_CHECK(pd_kvt_tiers_flush(w[0], 10000));
    int tier_of[NB];
    PD_CHECK_EQ(pd_kvt_tiers_match(w[1], hs, NB, tier_of, NULL), NB);
    for (int b = 0; b < NB; b++) PD_CHECK_EQ(tier_of[b], 1);  // from the pool, not its own DRAM
    float *kr[NB][2], *vr[NB][2];
    float *const *dk[NB], *const *dv[NB];
    for (int b = 0; b < NB; b++) {
        for (int l = 0; l < 2; l++) {
            kr[b][l] = out[b][l][0];
            vr[b][l] = out[b][l][1];
        }
        dk[b] = kr[b];
        dv[b] = vr[b];
    }
    int n_loaded = -1;
    PD_CHECK_EQ(pd_kvt_tiers_load(w[1], 1, hs, NB, dk, dv, on_loaded, &n_loaded), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(w[1], 10000));
    PD_CHECK_EQ(n_loaded, NB);
    double worst = 0;
    for (int b = 0; b < NB; b++)
        for (int l = 0; l < 2; l++)
            for (int kv = 0; kv < 2; kv++)
                for (int i = 0; i < 64; i++) {
                    double a = data[b][l][kv][i], e = fabs(a - out[b][l][kv][i]);
                    if (e > fabs(a) / 128 + 1e-7 && e > worst) worst = e;
                }
    PD_CHECK_MSG(worst == 0, "bf16 round trip off by %g", worst);
    pd_kvt_tiers_stats st;
    pd_kvt_tiers_stats_get(w[1], &st);
    PD_CHECK_EQ(st.promotions, NB);  // now in worker 2's DRAM
    PD_CHECK_EQ(st.tier[1].store.hits, NB);

    // Redis dies: a block only the pool had is a miss; the load completes (0 blocks).
    stop_redis(pid);
    pd_hash128 lost = pd_hash_block(&hs[NB - 1], (const int32_t[]){9, 9, 9, 9}, 4);
    n_loaded = -1;
    PD_CHECK_EQ(pd_kvt_tiers_load(w[1], 2, &lost, 1, dk, dv, on_loaded, &n_loaded), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(w[1], 10000));
    PD_CHECK_EQ(n_loaded, 0);
    // Its own DRAM still serves what it promoted.
    PD_CHECK_EQ(pd_kvt_tiers_match(w[1], hs, NB, tier_of, NULL), NB);
    PD_CHECK_EQ(tier_of[0], 0);
    pd_kvt_tiers_free(w[0]);
    pd_kvt_tiers_free(w[1]);
}

// The pool moves KV: a server with requirepass takes only workers that prove the shared secret.
// A wrong or missing secret: every put fails and every get misses (counted), nothing is stored.
PD_TEST(redis_auth_secret) {
    if (system("command -v redis-server >/dev/null 2>&1") != 0) PD_SKIP("redis-server not installed");
    int port = free_port();
    PD_REQUIRE(port > 0);
    pid_t pid = fork();
    if (pid == 0) {
        char ps[16];
        snprintf(ps, sizeof ps, "%d", port);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--requirepass", "0123456789abcdef-shared", (char *)NULL);
        _exit(127);
    }
    PD_REQUIRE(pid > 0);
    bool up = false;
    for (int i = 0; i < 200 && !up; i++) {  // bounded: 10 s; an unauthenticated PING is refused
        struct timeval tv = {0, 100000};
        redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "PING");
            up = r != NULL;
            if (r) freeReplyObject(r);
        }
        if (c) redisFree(c);
        if (!up) usleep(50000);
    }
    PD_REQUIRE(up);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    pd_err err = {0};
    pd_kvt_store_params sp = {.geom = G, .fingerprint = 0xabcdef, .secret = "0123456789abcdef-shared"};
    pd_kvt_store *good = pd_kvt_redis_new(&sp, url, &err);
    sp.secret = "not-the-secret";
    pd_kvt_store *wrong = pd_kvt_redis_new(&sp, url, &err);
    sp.secret = NULL;
    pd_kvt_store *none = pd_kvt_redis_new(&sp, url, &err);
    PD_REQUIRE(good && wrong && none);
    size_t n, got = 0;
    pd_hash128 h = {31, 32}, h2 = {41, 42};
    uint8_t *p = mkpage(0xabcdef, h, 0.5f, &n), *p2 = mkpage(0xabcdef, h2, 0.25f, &n);
    uint8_t *buf = malloc(n);
    PD_CHECK_EQ(pd_kvt_store_put(wrong, h, p, n), PD_ERR_IO);
    PD_CHECK(pd_kvt_redis_auth_failures(wrong) >= 1);
    PD_CHECK_EQ(pd_kvt_store_put(none, h2, p2, n), PD_ERR_IO);  // NOAUTH
    PD_CHECK_EQ(pd_kvt_store_put(good, h, p, n), PD_OK);
    PD_CHECK_EQ(pd_kvt_store_get(good, h, buf, n, &got), PD_OK);
    PD_CHECK(got == n && memcmp(buf, p, n) == 0);
    PD_CHECK_EQ(pd_kvt_store_get(wrong, h, buf, n, &got), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_kvt_store_get(none, h, buf, n, &got), PD_ERR_NOTFOUND);
    PD_CHECK(!pd_kvt_store_contains(good, h2));  // the unauthenticated put stored nothing
    PD_CHECK_EQ(pd_kvt_redis_auth_failures(good), 0);
    pd_kvt_store_free(good);
    pd_kvt_store_free(wrong);
    pd_kvt_store_free(none);
    free(p);
    free(p2);
    free(buf);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

// ---- keyspace notifications (kvtier/notify.c) -------------------------------------------------------
PD_TEST(redis_notify_parse) {
    const uint64_t fp = 0xabcdef;
    char ch[256];
    pd_hash128 h = {0};
#define P(chan, ev) pd_kvt_notify_parse((chan), strlen(chan), (ev), strlen(ev), fp, &h)
    snprintf(ch, sizeof ch, "__keyspace@0__:pdkv:%016llx:%016llx%016llx", 0xabcdefull, 0x22ull, 0x21ull);
    PD_CHECK_EQ(P(ch, "evicted"), PD_KVT_NOTIFY_EVICTED);
    PD_CHECK(h.hi == 0x22 && h.lo == 0x21);
    PD_CHECK_EQ(P(ch, "expired"), PD_KVT_NOTIFY_EXPIRED);
    PD_CHECK_EQ(P(ch, "del"), PD_KVT_NOTIFY_DEL);
    PD_CHECK_EQ(P(ch, "rename_from"), PD_KVT_NOTIFY_DEL);
    PD_CHECK_EQ(P(ch, "set"), PD_KVT_NOTIFY_OTHER);      // ours, not a removal
    PD_CHECK_EQ(P(ch, "evictedX"), PD_KVT_NOTIFY_OTHER);
    PD_CHECK_EQ(P(ch, ""), PD_KVT_NOTIFY_OTHER);
    PD_CHECK_EQ(P(ch, "evicted_evicted_evicted_evicted_x"), PD_KVT_NOTIFY_BAD);  // event > 32 bytes
    snprintf(ch, sizeof ch, "__keyspace@15__:pdkv:%016llx:%032d", 0xabcdefull, 7);
    PD_CHECK_EQ(P(ch, "del"), PD_KVT_NOTIFY_DEL);          // another database number: still our key
    PD_CHECK(h.hi == 0 && h.lo == 7);
    const char *bad[] = {
        "__keyspace@0__:pdkv:0000000000abcdef:0000000000000022000000000000002",    // 31 hex digits
        "__keyspace@0__:pdkv:0000000000abcdef:00000000000000220000000000000021a",  // 33
        "__keyspace@0__:pdkv:0000000000abcdef:000000000000002200000000000000zz",   // not hex
        "__keyspace@0__:pdkv:0000000000abcdef:00000000000000220000000000000A21",   // upper case
        "__keyspace@0__:pdkv:0000000000000123:00000000000000220000000000000021",   // another model
        "__keyspace@0__:pdkv:0000000000abcdef-00000000000000220000000000000021",   // separator
        "__keyspace@0__:pdkv:abcdef:00000000000000220000000000000021",             // short fp
        "__keyspace@__:pdkv:0000000000abcdef:00000000000000220000000000000021",    // no db
        "__keyspace@x__:pdkv:0000000000abcdef:00000000000000220000000000000021",
        "__keyevent@0__:pdkv:0000000000abcdef:00000000000000220000000000000021",   // not keyspace
        "__keyspace@0__:lmc:0000000000abcdef:00000000000000220000000000000021",    // not our prefix
        "__keyspace@0__:pdkv:0000000000abcdef:",
        "__keyspace@0__:",
        "__keyspace@",
        "",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (P(bad[i], "del") != PD_KVT_NOTIFY_BAD) fprintf(stderr, "accepted: %s\n", bad[i]);
        PD_CHECK_EQ(P(bad[i], "del"), PD_KVT_NOTIFY_BAD);
    }
    // Lengths are checked before content: a huge channel, a channel with a NUL inside.
    char *huge = malloc(1 << 20);
    memset(huge, 'a', 1 << 20);
    memcpy(huge, "__keyspace@0__:pdkv:", 20);
    PD_CHECK_EQ(pd_kvt_notify_parse(huge, 1 << 20, "del", 3, fp, &h), PD_KVT_NOTIFY_BAD);
    free(huge);
    snprintf(ch, sizeof ch, "__keyspace@0__:pdkv:%016llx:%016llx%016llx", 0xabcdefull, 0x22ull, 0x21ull);
    ch[30] = 0;
    PD_CHECK_EQ(pd_kvt_notify_parse(ch, 69, "del", 3, fp, &h), PD_KVT_NOTIFY_BAD);
    PD_CHECK_EQ(pd_kvt_notify_parse(NULL, 0, "del", 3, fp, &h), PD_KVT_NOTIFY_BAD);
#undef P
    // Flags: K plus e, x, g (A covers them); merge adds what is missing, keeps the rest.
    PD_CHECK(pd_kvt_notify_flags_ok("KEA") && pd_kvt_notify_flags_ok("Kgxe") && pd_kvt_notify_flags_ok("AK"));
    PD_CHECK(!pd_kvt_notify_flags_ok("") && !pd_kvt_notify_flags_ok("EA") && !pd_kvt_notify_flags_ok("Kgx") &&
             !pd_kvt_notify_flags_ok(NULL));
    char m[32];
    pd_kvt_notify_flags_merge("", m, sizeof m);
    PD_CHECK(!strcmp(m, "Kexg") && pd_kvt_notify_flags_ok(m));
    pd_kvt_notify_flags_merge("E$", m, sizeof m);
    PD_CHECK(!strcmp(m, "E$Kexg"));
    pd_kvt_notify_flags_merge("EA", m, sizeof m);
    PD_CHECK(!strcmp(m, "EAK"));
}

typedef struct heard {
    pthread_mutex_t mu;
    int n[4];
    pd_hash128 last;
} heard;

static void on_heard(void *ud, pd_hash128 h, pd_kvt_notify_kind k) {
    heard *x = ud;
    pthread_mutex_lock(&x->mu);
    if (k >= 0 && k < 4) x->n[k]++;
    x->last = h;
    pthread_mutex_unlock(&x->mu);
}

static int heard_n(heard *x, int k) {
    pthread_mutex_lock(&x->mu);
    int n = x->n[k];
    pthread_mutex_unlock(&x->mu);
    return n;
}

static bool wait_until(bool (*cond)(void *), void *ud) {
    for (int i = 0; i < 200; i++) {  // bounded: 10 s
        if (cond(ud)) return true;
        usleep(50000);
    }
    return false;
}

static pd_kvt_notify *g_n;
static bool subscribed(void *ud) {
    pd_kvt_notify_stats s;
    pd_kvt_notify_stats_get(g_n, &s);
    return s.subscribes >= *(int *)ud;
}
static bool refused(void *ud) {
    pd_kvt_notify_stats s;
    pd_kvt_notify_stats_get(g_n, &s);
    return s.config_refused >= 1 && s.subscribes >= 1;
}
static heard g_heard = {.mu = PTHREAD_MUTEX_INITIALIZER};
static bool heard_del(void *ud) { return heard_n(&g_heard, PD_KVT_NOTIFY_DEL) >= *(int *)ud; }
static bool heard_evicted(void *ud) { return heard_n(&g_heard, PD_KVT_NOTIFY_EVICTED) >= *(int *)ud; }
static bool ignored_n(void *ud) {
    pd_kvt_notify_stats s;
    pd_kvt_notify_stats_get(g_n, &s);
    return s.ignored >= *(int *)ud;
}

static void rcmd(redisContext *c, const char *fmt, const char *a, size_t alen) {
    redisReply *r = a ? redisCommand(c, fmt, a, alen) : redisCommand(c, fmt);
    if (r) freeReplyObject(r);
}

// A server without notifications: the subscriber turns them on (CONFIG SET, keeping what was
// there), hears DEL and maxmemory evictions of our keys with their hashes, ignores other keys,
// reconnects after the server restarts. A server that refuses CONFIG: counted, no crash.
PD_TEST(redis_notify_live) {
    if (system("command -v redis-server >/dev/null 2>&1") != 0) PD_SKIP("redis-server not installed");
    int port = free_port();
    PD_REQUIRE(port > 0);
    const char *extra[] = {"--notify-keyspace-events", "E$", NULL};
    pid_t pid = start_redis_args(port, extra);
    PD_REQUIRE(pid > 0);
    const uint64_t fp = 0xabcdef;
    pd_err err = {0};
    g_n = pd_kvt_notify_start("127.0.0.1", port, NULL, fp, on_heard, &g_heard, &err);
    PD_REQUIRE(g_n);
    int one = 1;
    PD_REQUIRE(wait_until(subscribed, &one));
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    PD_REQUIRE(c && !c->err);
    redisReply *r = redisCommand(c, "CONFIG GET notify-keyspace-events");
    PD_REQUIRE(r && r->type == REDIS_REPLY_ARRAY && r->elements == 2);
    PD_CHECK(pd_kvt_notify_flags_ok(r->element[1]->str));
    PD_CHECK(strchr(r->element[1]->str, '$') != NULL);  // what was there is kept
    freeReplyObject(r);

    char key[96];
    snprintf(key, sizeof key, "pdkv:%016llx:%016llx%016llx", 0xabcdefull, 0x22ull, 0x21ull);
    rcmd(c, "SET %b x", key, strlen(key));
    rcmd(c, "DEL %b", key, strlen(key));
    PD_CHECK(wait_until(heard_del, &one));
    pthread_mutex_lock(&g_heard.mu);
    pd_hash128 last = g_heard.last;
    pthread_mutex_unlock(&g_heard.mu);
    PD_CHECK(last.hi == 0x22 && last.lo == 0x21);
    // Another model's key is not even sent (the pattern has our fingerprint); a bad one of ours is
    // heard and counted.
    snprintf(key, sizeof key, "pdkv:%016llx:%016llx%016llx", 0x123ull, 1ull, 2ull);
    rcmd(c, "SET %b x", key, strlen(key));
    rcmd(c, "DEL %b", key, strlen(key));
    snprintf(key, sizeof key, "pdkv:%016llx:nothex", 0xabcdefull);
    rcmd(c, "SET %b x", key, strlen(key));
    rcmd(c, "DEL %b", key, strlen(key));
    int two = 2;
    PD_CHECK(wait_until(ignored_n, &two));
    PD_CHECK_EQ(heard_n(&g_heard, PD_KVT_NOTIFY_DEL), 1);

    // maxmemory evictions: 64 KiB values under a 2 MB cap over the server's own use.
    r = redisCommand(c, "INFO memory");
    long long used = 0;
    if (r && r->type == REDIS_REPLY_STRING) {
        const char *u = strstr(r->str, "used_memory:");
        if (u) used = atoll(u + 12);
    }
    if (r) freeReplyObject(r);
    PD_REQUIRE(used > 0);
    char mm[32];
    snprintf(mm, sizeof mm, "%lld", used + (2ll << 20));
    rcmd(c, "CONFIG SET maxmemory-policy allkeys-lru", NULL, 0);
    r = redisCommand(c, "CONFIG SET maxmemory %s", mm);
    PD_REQUIRE(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    char *val = calloc(1, 65536);
    for (int i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "pdkv:%016llx:%032x", 0xabcdefull, i);
        r = redisCommand(c, "SET %s %b", key, val, (size_t)65536);
        if (r) freeReplyObject(r);
    }
    free(val);
    r = redisCommand(c, "INFO stats");
    long long evicted = 0;
    if (r && r->type == REDIS_REPLY_STRING) {
        const char *u = strstr(r->str, "evicted_keys:");
        if (u) evicted = atoll(u + 13);
    }
    if (r) freeReplyObject(r);
    PD_CHECK(evicted >= 16);
    int ev = (int)evicted;
    PD_CHECK(wait_until(heard_evicted, &ev));
    PD_CHECK_EQ(heard_n(&g_heard, PD_KVT_NOTIFY_EVICTED), ev);
    redisFree(c);

    // The server restarts (notifications off again): the subscriber reconnects and turns them on.
    stop_redis(pid);
    pid = start_redis_args(port, NULL);
    PD_REQUIRE(pid > 0);
    PD_CHECK(wait_until(subscribed, &two));
    c = redisConnectWithTimeout("127.0.0.1", port, tv);
    PD_REQUIRE(c && !c->err);
    snprintf(key, sizeof key, "pdkv:%016llx:%032x", 0xabcdefull, 99);
    rcmd(c, "SET %b x", key, strlen(key));
    rcmd(c, "DEL %b", key, strlen(key));
    PD_CHECK(wait_until(heard_del, &two));
    redisFree(c);
    pd_kvt_notify_stats st;
    pd_kvt_notify_stats_get(g_n, &st);
    PD_CHECK_EQ(st.config_refused, 0);
    PD_CHECK(st.drops >= 1);
    pd_kvt_notify_stop(g_n);
    stop_redis(pid);

    // CONFIG renamed away (a managed Redis): refused, counted; still subscribed.
    const char *noconf[] = {"--rename-command", "CONFIG", "", NULL};
    pid = start_redis_args(port, noconf);
    PD_REQUIRE(pid > 0);
    g_n = pd_kvt_notify_start("127.0.0.1", port, NULL, fp, on_heard, &g_heard, &err);
    PD_REQUIRE(g_n);
    PD_CHECK(wait_until(refused, NULL));
    pd_kvt_notify_stop(g_n);
    g_n = NULL;
    stop_redis(pid);
}

// ---- a hostile or broken Redis: the subscriber's fault cases -------------------------------------------
// A fake server on a loopback port answers the subscriber's handshake (CONFIG GET, PSUBSCRIBE) and
// then pushes, on its first connection: a notification of another model's key, one with a hash that
// is not hex, a 3-element array, a 4-element array with an integer, a good "evicted", then a bulk
// string announced at 5 MB and fed past the 1 MiB cap (the connection must be dropped); on its
// second connection (the reconnect): a good "del", then half a message and a close (a peer dying
// mid-message). Exactly the two good ones may reach the callback, with their hashes.
typedef struct fake_redis {
    int lfd;
    uint64_t fp;
    pd_hash128 h1, h2;
    bool ok;  // the script ran to its end
} fake_redis;

static bool fr_wait_for(int fd, const char *needle) {  // reads until needle was seen (bounded: 5 s)
    char buf[4096];
    size_t n = 0;
    for (int i = 0; i < 100; i++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        ssize_t r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (r <= 0) return false;
        n += (size_t)r;
        buf[n] = 0;
        if (strstr(buf, needle)) return true;
        if (n == sizeof buf - 1) n = 0;
    }
    return false;
}

static bool fr_send(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w <= 0) return false;
        s += w, n -= (size_t)w;
    }
    return true;
}
static bool fr_puts(int fd, const char *s) { return fr_send(fd, s, strlen(s)); }

static bool fr_bulk(char *out, size_t cap, const char *s) {
    size_t o = strlen(out);
    return (size_t)snprintf(out + o, cap - o, "$%zu\r\n%s\r\n", strlen(s), s) < cap - o;
}

static bool fr_pmessage(int fd, const char *channel, const char *event) {
    char m[512] = "*4\r\n";
    return fr_bulk(m, sizeof m, "pmessage") && fr_bulk(m, sizeof m, "__keyspace@0__:pdkv:*") &&
           fr_bulk(m, sizeof m, channel) && fr_bulk(m, sizeof m, event) && fr_puts(fd, m);
}

static int fr_accept_handshake(fake_redis *f) {
    struct pollfd p = {.fd = f->lfd, .events = POLLIN};
    if (poll(&p, 1, 5000) <= 0) return -1;
    int fd = accept(f->lfd, NULL, NULL);
    if (fd < 0) return -1;
    bool ok = fr_wait_for(fd, "notify-keyspace-events") &&
              fr_puts(fd, "*2\r\n$22\r\nnotify-keyspace-events\r\n$3\r\nKEA\r\n") && fr_wait_for(fd, "PSUBSCRIBE") &&
              fr_puts(fd, "*3\r\n$10\r\npsubscribe\r\n$21\r\n__keyspace@0__:pdkv:*\r\n:1\r\n");
    if (!ok) close(fd);
    return ok ? fd : -1;
}

static void fr_channel(char *out, size_t n, uint64_t fp, pd_hash128 h) {
    snprintf(out, n, "__keyspace@0__:pdkv:%016" PRIx64 ":%016" PRIx64 "%016" PRIx64, fp, h.hi, h.lo);
}

static void *fake_redis_main(void *arg) {
    fake_redis *f = arg;
    char ch[160];
    int fd = fr_accept_handshake(f);
    if (fd < 0) return NULL;
    bool ok = true;
    fr_channel(ch, sizeof ch, f->fp + 1, f->h1);  // another model's key
    ok = ok && fr_pmessage(fd, ch, "evicted");
    fr_channel(ch, sizeof ch, f->fp, f->h1);
    ch[strlen(ch) - 1] = 'g';  // not hex
    ok = ok && fr_pmessage(fd, ch, "evicted");
    ok = ok && fr_puts(fd, "*3\r\n$8\r\npmessage\r\n$1\r\na\r\n$1\r\nb\r\n");
    ok = ok && fr_puts(fd, "*4\r\n$8\r\npmessage\r\n$1\r\na\r\n:7\r\n$7\r\nevicted\r\n");
    fr_channel(ch, sizeof ch, f->fp, f->h1);
    ok = ok && fr_pmessage(fd, ch, "evicted");
    ok = ok && fr_puts(fd, "$5000000\r\n");
    static char junk[64 << 10];
    memset(junk, 'a', sizeof junk);
    for (int i = 0; ok && i < 24; i++) ok = fr_send(fd, junk, sizeof junk);  // 1.5 MiB: past the cap
    // The subscriber drops the connection (a send may fail once it has); wait for it to go.
    for (int i = 0; i < 100; i++) {
        char b[256];
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) > 0 && recv(fd, b, sizeof b, 0) <= 0) break;
    }
    close(fd);
    fd = fr_accept_handshake(f);
    if (fd < 0) return NULL;
    fr_channel(ch, sizeof ch, f->fp, f->h2);
    ok = fr_pmessage(fd, ch, "del") && fr_puts(fd, "*4\r\n$8\r\npmessage\r\n$3\r\nab");
    usleep(200000);
    close(fd);  // mid-message
    f->ok = ok;
    return NULL;
}

static heard g_fake_heard = {.mu = PTHREAD_MUTEX_INITIALIZER};
static bool fake_drops2(void *ud) {
    (void)ud;
    pd_kvt_notify_stats s;
    pd_kvt_notify_stats_get(g_n, &s);
    return s.drops >= 2 && heard_n(&g_fake_heard, PD_KVT_NOTIFY_DEL) >= 1;
}

PD_TEST(redis_notify_hostile_server) {
    fake_redis f = {.fp = 0x5eed, .h1 = {.lo = 0x1111, .hi = 0x2222}, .h2 = {.lo = 0x3333, .hi = 0x4444}};
    f.lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    PD_REQUIRE(f.lfd >= 0 && !bind(f.lfd, (struct sockaddr *)&a, sizeof a) && !listen(f.lfd, 4) &&
               !getsockname(f.lfd, (struct sockaddr *)&a, &l));
    pthread_t th;
    PD_REQUIRE(!pthread_create(&th, NULL, fake_redis_main, &f));
    pd_err err = {0};
    g_n = pd_kvt_notify_start("127.0.0.1", ntohs(a.sin_port), NULL, f.fp, on_heard, &g_fake_heard, &err);
    PD_REQUIRE(g_n);
    PD_CHECK(wait_until(fake_drops2, NULL));
    pthread_join(th, NULL);
    PD_CHECK(f.ok);
    pd_kvt_notify_stats st;
    pd_kvt_notify_stats_get(g_n, &st);
    pd_kvt_notify_stop(g_n);
    g_n = NULL;
    close(f.lfd);
    // Exactly the two good notifications reached the callback, with their hashes.
    PD_CHECK_EQ(heard_n(&g_fake_heard, PD_KVT_NOTIFY_EVICTED), 1);
    PD_CHECK_EQ(heard_n(&g_fake_heard, PD_KVT_NOTIFY_DEL), 1);
    PD_CHECK_EQ(heard_n(&g_fake_heard, PD_KVT_NOTIFY_EXPIRED), 0);
    PD_CHECK_EQ(st.evicted, 1);
    PD_CHECK_EQ(st.deleted, 1);
    PD_CHECK(g_fake_heard.last.lo == f.h2.lo && g_fake_heard.last.hi == f.h2.hi);
    // foreign key, bad hash, 3 elements, integer element, the oversized reply: each ignored
    PD_CHECK(st.ignored >= 5);
    PD_CHECK(st.drops >= 2);       // the oversized reply, the close mid-message
    PD_CHECK(st.subscribes >= 2);  // reconnected in between
}
