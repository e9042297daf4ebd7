// test_api_prep.c — parsing, chat templating and tokenizing run on the preparation pool, off the
// event loop. The proof is by ordering, not by time: a test hook holds one request inside its
// preparation (as a huge prompt would) while a second, streaming request is served to its end; the
// first completes only after it is released. Also: a client that disconnects while its request is
// being prepared gets nothing submitted to the engine, and pd_api_free with a request still in the
// pool frees everything. The real engine (kjv-llama-6m, CPU) and HTTP stack on 127.0.0.1:0.
#include "test.h"

#include <arpa/inet.h>
#include <event2/event.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <unistd.h>

#include "api/api.h"
#include "api/api_impl.h"
#include "api/prep.h"

// ---- the hook: holds bodies containing "HOLD" until released -------------------------------------
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static bool g_release;
static atomic_int g_n_held, g_n_prepared;

static void hook(const char *body, size_t len) {
    atomic_fetch_add(&g_n_prepared, 1);
    if (!memmem(body, len, "HOLD", 4)) return;
    pthread_mutex_lock(&g_mu);
    atomic_fetch_add(&g_n_held, 1);
    while (!g_release) pthread_cond_wait(&g_cv, &g_mu);
    atomic_fetch_sub(&g_n_held, 1);
    pthread_mutex_unlock(&g_mu);
}

static void hold_reset(void) {
    pthread_mutex_lock(&g_mu);
    g_release = false;
    pthread_mutex_unlock(&g_mu);
    atomic_store(&g_n_prepared, 0);
    pd_api_prep_set_test_hook(hook);
}

static void release(void) {
    pthread_mutex_lock(&g_mu);
    g_release = true;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

// ---- fixture ---------------------------------------------------------------------------------------
typedef struct fx {
    pd_engine *eng;
    struct event_base *base;
    pd_api *api;
} fx;

static bool fx_init(fx *f) {
    memset(f, 0, sizeof *f);
    char dir[1024];
    pd_engine_params ep = pd_engine_params_default();
    ep.model_dir = pd_test_path(dir, sizeof dir, "kjv-llama-6m");
    ep.device = "cpu";
    ep.n_blocks = 256;
    pd_err err = {0};
    f->eng = pd_engine_new(&ep, &err);
    PD_CHECK_MSG(f->eng != NULL, "engine: %s", err.msg);
    if (!f->eng) return false;
    PD_CHECK_EQ(pd_engine_start(f->eng), PD_OK);
    f->base = event_base_new();
    pd_api_params ap = pd_api_params_default();
    ap.port = 0;
    f->api = pd_api_new(f->base, f->eng, &ap, &err);
    PD_CHECK_MSG(f->api != NULL, "api: %s", err.msg);
    return f->api != NULL;
}

static void fx_fini(fx *f) {
    pd_api_free(f->api);
    pd_engine_free(f->eng);
    if (f->base) event_base_free(f->base);
    pd_api_prep_set_test_hook(NULL);
}

static int conn(fx *f) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)pd_api_port(f->api))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_CHECK_EQ(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    return fd;
}

static void send_req(fx *f, int fd, const char *path, const char *body) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     path, strlen(body), body);
    size_t off = 0;
    int64_t deadline = pd_time_us() + 5000000;
    while (off < (size_t)n && pd_time_us() < deadline) {
        ssize_t k = send(fd, buf + off, (size_t)n - off, MSG_NOSIGNAL);
        if (k > 0) off += (size_t)k;
        event_base_loop(f->base, EVLOOP_NONBLOCK);
    }
}

// Appends what fd has now to acc (no waiting); false on EOF.
static bool drain(int fd, char *acc, size_t cap, size_t *len) {
    for (;;) {
        ssize_t k = recv(fd, acc + *len, cap - *len - 1, 0);
        if (k == 0) return false;
        if (k < 0) return true;
        *len += (size_t)k;
        acc[*len] = 0;
    }
}

// Pumps the loop until cond(ud) holds or 20 s pass (a bound, not a measurement).
static bool pump_until(fx *f, bool (*cond)(void *), void *ud) {
    int64_t deadline = pd_time_us() + 20000000;
    while (pd_time_us() < deadline) {
        event_base_loop(f->base, EVLOOP_NONBLOCK);
        if (cond(ud)) return true;
    }
    return false;
}

static bool held_one(void *ud) { PD_UNUSED(ud); return atomic_load(&g_n_held) == 1; }

typedef struct reader {
    int fd;
    char buf[1 << 16];
    size_t len;
    const char *until;
} reader;

static bool got(void *ud) {
    reader *r = ud;
    drain(r->fd, r->buf, sizeof r->buf, &r->len);
    return strstr(r->buf, r->until) != NULL;
}

static bool idle(void *ud) {
    fx *f = ud;
    pd_engine_stats s;
    pd_engine_stats_get(f->eng, &s);
    return pd_api_n_jobs(f->api) == 0 && pd_api_n_engine_requests(f->api) == 0 && s.n_running == 0 &&
           s.n_waiting == 0 && s.n_blocks_used == 0;
}

PD_TEST(prep_runs_off_the_event_loop) {
    hold_reset();
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    PD_CHECK(pd_api_prep_n_threads(f.api->prep) >= 2);
    static reader a, b, c;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&c, 0, sizeof c);
    // B: a running stream.
    b.fd = conn(&f);
    send_req(&f, b.fd, "/v1/completions",
             "{\"prompt\":\"And God said\",\"max_tokens\":64,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}");
    b.until = "\"text\":";
    PD_REQUIRE(pump_until(&f, got, &b));
    // A: held inside its preparation, as a maximal prompt would be (before this pool existed, it
    // was tokenized on the loop thread and every stream stopped until it was done).
    a.fd = conn(&f);
    send_req(&f, a.fd, "/v1/chat/completions",
             "{\"messages\":[{\"role\":\"user\",\"content\":\"HOLD In the beginning\"}],\"max_tokens\":4,\"temperature\":0}");
    PD_REQUIRE(pump_until(&f, held_one, NULL));
    size_t b_at_hold = b.len;
    // B streams to its end while A is held ...
    b.until = "data: [DONE]";
    PD_CHECK(pump_until(&f, got, &b));
    PD_CHECK(b.len > b_at_hold);
    int n_chunks = 0;
    for (const char *p = b.buf; (p = strstr(p, "\"text\":")); p++) n_chunks++;
    PD_CHECK(n_chunks >= 64);  // every token streamed
    // ... and a new request C is prepared and answered meanwhile (another worker).
    c.fd = conn(&f);
    send_req(&f, c.fd, "/v1/completions", "{\"prompt\":\"And\",\"max_tokens\":3,\"temperature\":0}");
    c.until = "\"total_tokens\"";
    PD_CHECK(pump_until(&f, got, &c));
    PD_CHECK_CONTAINS(c.buf, "HTTP/1.1 200 OK");
    // A has not been answered and is still held.
    PD_CHECK_EQ(atomic_load(&g_n_held), 1);
    drain(a.fd, a.buf, sizeof a.buf, &a.len);
    PD_CHECK_EQ(a.len, 0);
    PD_CHECK_EQ(pd_api_prep_n_pending(f.api->prep), 1);
    // Released, A completes normally.
    release();
    a.until = "\"total_tokens\"";
    PD_CHECK(pump_until(&f, got, &a));
    PD_CHECK_CONTAINS(a.buf, "HTTP/1.1 200 OK");
    PD_CHECK_CONTAINS(a.buf, "\"completion_tokens\":4");
    close(a.fd);
    close(b.fd);
    close(c.fd);
    PD_CHECK(pump_until(&f, idle, &f));
    PD_CHECK_EQ(pd_api_prep_n_pending(f.api->prep), 0);
    fx_fini(&f);
}

PD_TEST(prep_errors_come_back_to_the_client) {
    hold_reset();
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    static reader a;
    memset(&a, 0, sizeof a);
    a.fd = conn(&f);
    send_req(&f, a.fd, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":\"many\"}");
    a.until = "\"param\"";
    PD_CHECK(pump_until(&f, got, &a));
    PD_CHECK_CONTAINS(a.buf, "HTTP/1.1 400");
    PD_CHECK_CONTAINS(a.buf, "max_tokens");
    close(a.fd);
    // /internal/tokenize goes through the pool too, chat detected from the body.
    memset(&a, 0, sizeof a);
    a.fd = conn(&f);
    send_req(&f, a.fd, "/internal/tokenize", "{\"messages\":[{\"role\":\"user\",\"content\":\"And\"}]}");
    a.until = "]}";
    PD_CHECK(pump_until(&f, got, &a));
    PD_CHECK_CONTAINS(a.buf, "{\"token_ids\":[");
    close(a.fd);
    PD_CHECK(pump_until(&f, idle, &f));
    fx_fini(&f);
}

static bool one_cancelled(void *ud) {
    fx *f = ud;
    return pd_api_prep_n_cancelled(f->api->prep) == 1;
}

PD_TEST(prep_client_disconnect_while_preparing) {
    hold_reset();
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    pd_engine_stats s0;
    pd_engine_stats_get(f.eng, &s0);
    int fd = conn(&f);
    send_req(&f, fd, "/v1/completions", "{\"prompt\":\"HOLD And\",\"max_tokens\":50,\"ignore_eos\":true}");
    PD_REQUIRE(pump_until(&f, held_one, NULL));
    close(fd);
    PD_CHECK(pump_until(&f, one_cancelled, &f));  // the close callback ran while it was held
    release();
    PD_CHECK(pump_until(&f, idle, &f));  // the job came back, was dropped, nothing leaked
    pd_engine_stats s1;
    pd_engine_stats_get(f.eng, &s1);
    PD_CHECK_EQ(s1.n_prompt_tokens, s0.n_prompt_tokens);  // nothing reached the engine
    fx_fini(&f);
}

PD_TEST(prep_free_with_a_request_in_the_pool) {
    hold_reset();
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    int fd = conn(&f);
    send_req(&f, fd, "/v1/completions", "{\"prompt\":\"HOLD And\",\"max_tokens\":5}");
    int fd2 = conn(&f);
    send_req(&f, fd2, "/v1/completions", "{\"prompt\":\"queued behind it\",\"max_tokens\":5}");
    PD_REQUIRE(pump_until(&f, held_one, NULL));
    release();  // the held job finishes on its worker whether or not the loop runs again
    fx_fini(&f);  // joins the workers, frees prepared and queued jobs (leak check by the harness)
    close(fd);
    close(fd2);
}
