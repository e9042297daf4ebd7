// test_api_server.c — pd_api end to end in one process: the real engine (kjv-llama-6m on the CPU,
// a small KV pool) and the HTTP API on 127.0.0.1 (port 0), driven by raw sockets from the test
// thread, which alternates between the event loop (EVLOOP_NONBLOCK) and the socket. Covers what
// the black-box tests can only see through /metrics: a client that disconnects (mid-stream or
// while waiting for a non-streaming reply) aborts its engine requests and frees its job; a stop
// string aborts the engine request; pd_api_free with requests in flight; the KV pool returns to
// fully free. Every wait has a deadline; nothing sleeps.
#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "api/api.h"

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
    ap.served_model_name = "kjv";
    f->api = pd_api_new(f->base, f->eng, &ap, &err);
    PD_CHECK_MSG(f->api != NULL, "api: %s", err.msg);
    return f->api != NULL;
}

static void fx_fini(fx *f) {
    pd_api_free(f->api);
    pd_engine_free(f->eng);
    if (f->base) event_base_free(f->base);
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
    int64_t deadline = pd_test_deadline_us(5);
    while (off < (size_t)n && pd_time_us() < deadline) {
        ssize_t k = send(fd, buf + off, (size_t)n - off, MSG_NOSIGNAL);
        if (k > 0) off += (size_t)k;
        event_base_loop(f->base, EVLOOP_NONBLOCK);
    }
}

// Pumps until `until` shows up in what fd received (or EOF / 20 s). Returns the bytes (pd_free).
static char *pump_until(fx *f, int fd, const char *until) {
    size_t cap = 1 << 20, len = 0;
    char *buf = pd_malloc(cap);
    buf[0] = 0;
    int64_t deadline = pd_test_deadline_us(20);
    while (pd_time_us() < deadline) {
        event_base_loop(f->base, EVLOOP_NONBLOCK);
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k == 0) break;
        if (k > 0) {
            len += (size_t)k;
            buf[len] = 0;
            if (until && strstr(buf, until)) break;
        }
    }
    return buf;
}

// Pumps until no job and no engine request is left and the engine holds no KV block.
static bool wait_idle(fx *f) {
    int64_t deadline = pd_test_deadline_us(20);
    while (pd_time_us() < deadline) {
        event_base_loop(f->base, EVLOOP_NONBLOCK);
        pd_engine_stats s;
        pd_engine_stats_get(f->eng, &s);
        if (pd_api_n_jobs(f->api) == 0 && pd_api_n_engine_requests(f->api) == 0 && s.n_running == 0 &&
            s.n_waiting == 0 && s.n_blocks_used == 0)
            return true;
    }
    return false;
}

PD_TEST(completion_roundtrip) {
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    int fd = conn(&f);
    send_req(&f, fd, "/v1/completions", "{\"prompt\":\"In the beginning\",\"max_tokens\":5,\"temperature\":0,\"ignore_eos\":true}");
    char *r = pump_until(&f, fd, "\"total_tokens\"");
    PD_CHECK_CONTAINS(r, "HTTP/1.1 200 OK");
    PD_CHECK_CONTAINS(r, "\"object\":\"text_completion\"");
    PD_CHECK_CONTAINS(r, "\"finish_reason\":\"length\"");
    PD_CHECK_CONTAINS(r, "\"completion_tokens\":5");
    pd_free(r);
    close(fd);
    PD_CHECK(wait_idle(&f));
    fx_fini(&f);
}

PD_TEST(disconnect_mid_stream_aborts) {
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    int fd = conn(&f);
    send_req(&f, fd, "/v1/chat/completions",
             "{\"messages\":[{\"role\":\"user\",\"content\":\"And\"}],\"max_tokens\":1000,\"ignore_eos\":true,\"stream\":true,\"n\":2}");
    char *r = pump_until(&f, fd, "\"delta\":{\"content\":");
    PD_CHECK_CONTAINS(r, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}");
    pd_free(r);
    PD_CHECK_EQ(pd_api_n_jobs(f.api), 1);
    PD_CHECK_EQ(pd_api_n_engine_requests(f.api), 2);
    close(fd);
    PD_CHECK(wait_idle(&f));  // both engine requests aborted, blocks back
    fx_fini(&f);
}

PD_TEST(disconnect_while_waiting_aborts) {
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    int fd = conn(&f);
    send_req(&f, fd, "/v1/completions", "{\"prompt\":\"And\",\"max_tokens\":1500,\"ignore_eos\":true}");
    int64_t deadline = pd_test_deadline_us(5);
    while (pd_api_n_jobs(f.api) == 0 && pd_time_us() < deadline) event_base_loop(f.base, EVLOOP_NONBLOCK);
    PD_CHECK_EQ(pd_api_n_jobs(f.api), 1);
    close(fd);
    PD_CHECK(wait_idle(&f));
    fx_fini(&f);
}

PD_TEST(stop_string_streaming) {
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    // Learn the greedy continuation, then stop on a piece of it.
    int fd = conn(&f);
    const char *base_req = "{\"prompt\":\"In the beginning God created the heaven\",\"max_tokens\":30,\"temperature\":0,\"ignore_eos\":true";
    char body[512];
    snprintf(body, sizeof body, "%s}", base_req);
    send_req(&f, fd, "/v1/completions", body);
    char *r = pump_until(&f, fd, "\"total_tokens\"");
    close(fd);
    const char *t = strstr(r, "\"text\":\"");
    PD_REQUIRE(t != NULL);
    t += 8;
    // Take 3 plain characters from offset 5 of the text as the stop string.
    char stop[8] = {0};
    memcpy(stop, t + 5, 3);
    PD_REQUIRE(!strpbrk(stop, "\\\""));
    size_t want_len = 0;
    const char *hit = strstr(t, stop);
    PD_REQUIRE(hit != NULL);
    want_len = (size_t)(hit - t);
    char want[256];
    snprintf(want, sizeof want, "%.*s", (int)want_len, t);
    pd_free(r);

    fd = conn(&f);
    snprintf(body, sizeof body, "%s,\"stream\":true,\"stop\":\"%s\"}", base_req, stop);
    send_req(&f, fd, "/v1/completions", body);
    r = pump_until(&f, fd, "data: [DONE]");
    PD_CHECK_CONTAINS(r, "\"finish_reason\":\"stop\"");
    // Concatenate the streamed texts.
    char got[512] = {0};
    for (const char *p = r; (p = strstr(p, "\"text\":\"")); ) {
        p += 8;
        const char *e = strchr(p, '"');
        if (!e) break;
        strncat(got, p, (size_t)(e - p));
        p = e;
    }
    PD_CHECK_STR(got, want);
    pd_free(r);
    close(fd);
    PD_CHECK(wait_idle(&f));  // the engine request was aborted at the stop string
    fx_fini(&f);
}

PD_TEST(free_with_requests_in_flight) {
    fx f;
    if (!fx_init(&f)) { fx_fini(&f); return; }
    int fd1 = conn(&f), fd2 = conn(&f);
    send_req(&f, fd1, "/v1/completions", "{\"prompt\":\"And\",\"max_tokens\":1500,\"ignore_eos\":true,\"stream\":true}");
    send_req(&f, fd2, "/v1/completions", "{\"prompt\":\"But\",\"max_tokens\":1500,\"ignore_eos\":true}");
    int64_t deadline = pd_test_deadline_us(5);
    while (pd_api_n_jobs(f.api) < 2 && pd_time_us() < deadline) event_base_loop(f.base, EVLOOP_NONBLOCK);
    PD_CHECK_EQ(pd_api_n_jobs(f.api), 2);
    fx_fini(&f);  // aborts both, frees everything (the harness checks for leaks)
    close(fd1);
    close(fd2);
}
