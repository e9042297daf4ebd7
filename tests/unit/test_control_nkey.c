// The control plane's nkey connection (control/control.c, sign_nonce) against a scripted NATS
// server on loopback: nonces whose ed25519 signature begins with a zero byte (1 in 256; libnats
// 3.4.1 sends such a signature as nothing, and nats-server refuses the CONNECT) must cost one
// connection attempt, at the first connect and at a reconnect, never the connection.
// Also pd_nkey_sign against RFC 8032's test vector.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "control/control.h"
#include "control/nkey.h"
#include "test.h"

// RFC 8032 section 7.1, test 1 (the seed as in test_nkey.c): the signature of the empty message.
#define RFC8032_SEED "SUAJ2YNRTXX72WTAXKCEV5ES5QWMIRCJYVUXWMTJDFYDXLADDSXH6YALCA"
#define RFC8032_SIG1                                                                                  \
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46b" \
    "d25bf5f0595bbe24655141438e7a100b"

PD_TEST(nkey_sign_rfc8032_vector) {
    uint8_t sig[PD_NKEY_SIG_LEN];
    char hex[2 * PD_NKEY_SIG_LEN + 1];
    PD_CHECK_EQ(pd_nkey_sign(RFC8032_SEED, "", 0, sig, NULL), PD_OK);
    for (int i = 0; i < PD_NKEY_SIG_LEN; i++) snprintf(hex + 2 * i, 3, "%02x", sig[i]);
    PD_CHECK_STR(hex, RFC8032_SIG1);
    pd_err err = {0};
    PD_CHECK_EQ(pd_nkey_sign("SUAJ2YNRTXX72WTAXKCEV5ES5QWMIRCJYVUXWMTJDFYDXLADDSXH6YALCB", "", 0, sig, &err),
                PD_ERR_INVALID);  // a typo: the checksum
}

// ---- a scripted NATS server: connection i gets nonce[i] in its INFO ----
#define MAX_CONNS 8
typedef struct fake_nats {
    int lfd, port;
    const char *seed;                  // to compute the signature each nonce must come back with
    const char *nonce[MAX_CONNS];
    bool drop_after_pong[MAX_CONNS];   // close the connection once it is established and the test
    bool drop_now;                     // (atomic) says so: the client reconnects
    int n_script;
    // results (guarded by mu)
    pthread_mutex_t mu;
    int n_conns;
    bool saw_connect[MAX_CONNS], sig_ok[MAX_CONNS];
    bool stop;  // atomic
    pthread_t th;
} fake_nats;

static void b64url(const uint8_t *p, int n, char *out) {  // RFC 4648 base64url, no padding
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    int k = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (int i = 0; i < n; i++) {
        acc = (acc << 8) | p[i];
        bits += 8;
        while (bits >= 6) out[k++] = A[(acc >> (bits -= 6)) & 63];
    }
    if (bits) out[k++] = A[(acc << (6 - bits)) & 63];
    out[k] = 0;
}

// Reads one \r\n line into buf (NUL-terminated, without the \r\n): its length, or -1 when the
// peer closed or 5 s passed (every wait is bounded).
static int read_line(int fd, char *buf, int cap) {
    int n = 0;
    while (n < cap - 1) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 5000) <= 0) return -1;
        char ch;
        if (read(fd, &ch, 1) != 1) return -1;
        if (ch == '\n') {
            if (n > 0 && buf[n - 1] == '\r') n--;
            buf[n] = 0;
            return n;
        }
        buf[n++] = ch;
    }
    return -1;
}

static void serve_one(fake_nats *f, int fd, int i) {
    char info[512], line[4096];
    const char *nonce = i < f->n_script ? f->nonce[i] : "AAAAAAAAAAAAAAA";
    snprintf(info, sizeof info,
             "INFO {\"server_id\":\"NFAKE\",\"version\":\"2.9.10\",\"proto\":1,\"host\":\"127.0.0.1\",\"port\":%d,"
             "\"headers\":true,\"auth_required\":true,\"max_payload\":1048576,\"client_id\":%d,\"nonce\":\"%s\"}\r\n",
             f->port, i + 1, nonce);
    if (send(fd, info, strlen(info), MSG_NOSIGNAL) < 0) return;  // (a peer gone: no SIGPIPE)
    if (read_line(fd, line, sizeof line) < 0 || strncmp(line, "CONNECT ", 8)) return;  // gave up: no CONNECT
    uint8_t sig[PD_NKEY_SIG_LEN];
    char want[100], *got = strstr(line, "\"sig\":\"");
    bool ok = pd_nkey_sign(f->seed, nonce, strlen(nonce), sig, NULL) == PD_OK;
    b64url(sig, PD_NKEY_SIG_LEN, want);
    ok = ok && got && !strncmp(got + 7, want, strlen(want)) && got[7 + strlen(want)] == '"';
    pthread_mutex_lock(&f->mu);
    f->saw_connect[i] = true;
    f->sig_ok[i] = ok;
    pthread_mutex_unlock(&f->mu);
    if (!ok) {
        const char *e = "-ERR 'Authorization Violation'\r\n";
        (void)!send(fd, e, strlen(e), MSG_NOSIGNAL);
        return;
    }
    while (!__atomic_load_n(&f->stop, __ATOMIC_ACQUIRE) && read_line(fd, line, sizeof line) >= 0) {
        if (strcmp(line, "PING")) continue;  // PING -> PONG; the rest is ignored
        if (send(fd, "PONG\r\n", 6, MSG_NOSIGNAL) != 6) return;
        if (i < MAX_CONNS && f->drop_after_pong[i]) {  // (bounded: 10 s)
            for (int k = 0; k < 1000 && !__atomic_load_n(&f->drop_now, __ATOMIC_ACQUIRE); k++) usleep(10000);
            return;
        }
    }
}

static void *fake_main(void *ud) {
    fake_nats *f = ud;
    while (!__atomic_load_n(&f->stop, __ATOMIC_ACQUIRE)) {
        struct pollfd pf = {.fd = f->lfd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0) continue;
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0) continue;
        pthread_mutex_lock(&f->mu);
        int i = f->n_conns++;
        pthread_mutex_unlock(&f->mu);
        if (i < MAX_CONNS) serve_one(f, fd, i);
        close(fd);
    }
    return NULL;
}

static bool fake_start(fake_nats *f) {
    f->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (f->lfd < 0 || bind(f->lfd, (struct sockaddr *)&a, sizeof a) || listen(f->lfd, 8) ||
        getsockname(f->lfd, (struct sockaddr *)&a, &al))
        return false;
    f->port = ntohs(a.sin_port);
    pthread_mutex_init(&f->mu, NULL);
    return pthread_create(&f->th, NULL, fake_main, f) == 0;
}

static void fake_stop(fake_nats *f) {
    __atomic_store_n(&f->stop, true, __ATOMIC_RELEASE);
    pthread_join(f->th, NULL);
    close(f->lfd);
    pthread_mutex_destroy(&f->mu);
}

// A nonce (15 characters of the server's alphabet, as nats-server makes them) whose signature with
// seed begins with a zero byte (zero = true) or not; distinct for distinct k.
static bool find_nonce(const char *seed, bool zero, int k, char out[16]) {
    for (int i = 0; i < 200000; i++) {
        uint8_t sig[PD_NKEY_SIG_LEN];
        snprintf(out, 16, "pdnonce%c%07d", 'a' + k, i);
        if (pd_nkey_sign(seed, out, strlen(out), sig, NULL) != PD_OK) return false;
        if ((sig[0] == 0) == zero) return true;
    }
    return false;
}

PD_TEST(ctl_nkey_zero_leading_signature_retried) {
    char dir[] = "/tmp/pd_ctlnk_XXXXXX", path[96];
    PD_CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/seed", dir);
    char seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1];
    PD_CHECK_EQ(pd_nkey_generate(seed, pub, NULL), PD_OK);
    PD_CHECK_EQ(pd_nkey_write_seed_file(path, seed, NULL), PD_OK);
    char z0[16], n1[16], z2[16], n3[16];
    PD_CHECK(find_nonce(seed, true, 0, z0) && find_nonce(seed, false, 1, n1));
    PD_CHECK(find_nonce(seed, true, 2, z2) && find_nonce(seed, false, 3, n3));
    // connect: z0 (abandoned), n1 (admitted, then dropped); reconnect: z2 (abandoned), n3 (stays)
    static fake_nats f;
    memset(&f, 0, sizeof f);
    f.seed = seed;
    f.nonce[0] = z0, f.nonce[1] = n1, f.nonce[2] = z2, f.nonce[3] = n3;
    f.n_script = 4;
    f.drop_after_pong[1] = true;
    PD_CHECK(fake_start(&f));
    char url[64];
    snprintf(url, sizeof url, "nats://127.0.0.1:%d", f.port);
    pd_ctl_params p = {.url = url, .nkey_seed_file = path, .sign_key = "secret", .reconnect_wait_ms = 20};
    pd_err err = {0};
    pd_ctl *c = pd_ctl_connect(&p, &err);
    PD_CHECK_MSG(c != NULL, "connect failed: %s", err.msg);
    pd_ctl_stats st = {0};
    if (c) {
        pd_ctl_stats_get(c, &st);
        PD_CHECK_EQ(st.nkey_zero_sigs, 1);
        PD_CHECK_EQ(st.reconnects, 0);
        __atomic_store_n(&f.drop_now, true, __ATOMIC_RELEASE);  // the server drops the connection
        // the reconnect after the drop: bounded wait (10 s) for it
        for (int i = 0; i < 1000; i++) {
            pd_ctl_stats_get(c, &st);
            if (st.reconnects >= 1 && pd_ctl_is_connected(c)) break;
            usleep(10000);
        }
        PD_CHECK_EQ(st.reconnects, 1);
        PD_CHECK(pd_ctl_is_connected(c));
        PD_CHECK_EQ(st.nkey_zero_sigs, 2);
        pd_ctl_free(c);
    }
    fake_stop(&f);
    PD_CHECK_EQ(f.n_conns, 4);
    // the abandoned attempts sent no CONNECT; the others a CONNECT with the right signature
    PD_CHECK(!f.saw_connect[0] && !f.saw_connect[2]);
    PD_CHECK(f.saw_connect[1] && f.sig_ok[1]);
    PD_CHECK(f.saw_connect[3] && f.sig_ok[3]);
    unlink(path);
    rmdir(dir);
}
