// run.c — `pdserve run`: the embedded default. On one machine it starts, as separate processes,
// one prefill worker, one decode worker and the router in front of them, waits until each answers
// /health, sends one sample chat request through the router, prints the answer, the URL, a curl
// example and the KV transport it chose (shm on CPU, cuda-ipc on a GPU), then keeps serving until
// Ctrl-C. A worker that dies is reported and the whole group stops. `--colocated` runs the
// single-process server instead (serve.c).
//
// The children are this same binary (/proc/self/exe) with `serve` / `router` arguments; their
// output goes to the terminal prefixed by nothing (each line already names its process).
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "backend/backend.h"
#include "cmd/cmd.h"
#include "http/client.h"

int pd_cmd_run_colocated(int argc, char **argv);  // serve.c

static volatile sig_atomic_t g_stop;
static void on_sig(int s) { (void)s; g_stop = 1; }

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &l) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

// One blocking request to 127.0.0.1:port. Returns the HTTP status (0 when there was no complete
// response); *body_out (pd_free) receives the response body, or NULL.
static int http_req(int port, const char *method, const char *path, const char *body, char **body_out, int timeout_ms) {
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    pd_http_client_request rq = {.method = method, .url = url, .body = body, .body_len = body ? strlen(body) : 0};
    int status = 0;
    return pd_http_fetch(&rq, timeout_ms, &status, body_out, NULL, NULL) == PD_OK ? status : 0;
}

typedef struct child {
    const char *name;
    pid_t pid;
    int port;
} child;

static pid_t spawn(char *const argv[]) {
    pid_t pid = fork();
    if (pid == 0) {
        execv("/proc/self/exe", argv);
        fprintf(stderr, "pdserve run: exec failed: %s\n", strerror(errno));
        _exit(127);
    }
    return pid;
}

static bool wait_health(child *c, int timeout_s) {
    int64_t end = pd_time_us() + (int64_t)timeout_s * 1000000;
    while (pd_time_us() < end && !g_stop) {
        char *b;
        int st = http_req(c->port, "GET", "/health", NULL, &b, 2000);
        pd_free(b);
        if (st == 200) return true;
        int ws;
        if (waitpid(c->pid, &ws, WNOHANG) == c->pid) {
            fprintf(stderr, "pdserve run: the %s process exited during start-up\n", c->name);
            c->pid = 0;
            return false;
        }
        poll(NULL, 0, 50);
    }
    return false;
}

static void stop_all(child *cs, int n) {
    for (int i = n - 1; i >= 0; i--)
        if (cs[i].pid > 0) kill(cs[i].pid, SIGTERM);
    for (int i = n - 1; i >= 0; i--) {
        if (cs[i].pid <= 0) continue;
        int ws;
        for (int k = 0; k < 100 && waitpid(cs[i].pid, &ws, WNOHANG) == 0; k++) poll(NULL, 0, 50);
        if (waitpid(cs[i].pid, &ws, WNOHANG) == 0) {
            kill(cs[i].pid, SIGKILL);
            waitpid(cs[i].pid, &ws, 0);
        }
    }
}

static void usage(void) {
    printf("usage: pdserve run [--model DIR] [--port P (default 8000)] [--device cpu|cuda|auto]\n"
           "                  [--disagg-min-tokens N] [--kv-transport tcp|shm|cuda-ipc|nccl]\n"
           "                  [--exit-after-sample] [--colocated] [serve options]\n"
           "  Starts a prefill worker, a decode worker and the router (separate processes) with the\n"
           "  bundled model, answers a sample request through the router, prints the URL, then serves\n"
           "  until Ctrl-C. KV moves over shm on the CPU and cuda-ipc on a GPU unless --kv-transport says.\n"
           "  --colocated  one process serving prefill and decode together instead\n"
           "  Other options (e.g. --num-kv-blocks N) are passed to both workers (see pdserve serve --help).\n");
}

#define MAX_FWD 64

// Prints the sample answer's text (choices[0].message.content) as "answer: ...".
static void print_answer(const char *body) {
    json_t *o = json_loads(body, 0, NULL);
    json_t *c = json_object_get(json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message"), "content");
    printf("answer: %s\n", json_is_string(c) ? json_string_value(c) : body);
    json_decref(o);
}

int pd_cmd_run(int argc, char **argv) {
    const char *model = NULL, *device = "auto", *min_tokens = "64", *kv_transport = NULL;
    int port = 8000, n_fwd = 0;
    char *fwd[MAX_FWD];
    bool exit_after = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--colocated")) {
            // The single-process server takes the same argv minus this flag.
            char **rest = calloc((size_t)argc, sizeof *rest);
            if (!rest) return 1;
            int n = 0;
            for (int k = 0; k < argc; k++)
                if (strcmp(argv[k], "--colocated")) rest[n++] = argv[k];
            int rc = pd_cmd_run_colocated(n, rest);
            free(rest);
            return rc;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (!strcmp(a, "--exit-after-sample")) exit_after = true;
        else if (i + 1 < argc && !strcmp(a, "--model")) model = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--device")) device = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--disagg-min-tokens")) min_tokens = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--kv-transport")) {
            kv_transport = argv[++i];
            if (strcmp(kv_transport, "tcp") && strcmp(kv_transport, "shm") && strcmp(kv_transport, "cuda-ipc") &&
                strcmp(kv_transport, "nccl"))
                return pd_cmd_usage_error("run", "--kv-transport must be tcp, shm, cuda-ipc or nccl");
        }
        else if (i + 1 < argc && !strcmp(a, "--port")) {
            long v;
            if (!pd_cmd_parse_int(argv[++i], &v) || v < 0 || v > 65535) return pd_cmd_usage_error("run", "bad --port");
            port = (int)v;
        } else {
            if (n_fwd == MAX_FWD) return pd_cmd_usage_error("run", "too many options");
            fwd[n_fwd++] = argv[i];  // a serve option (or its value) for both workers
        }
    }
    if (!model) model = pd_cmd_default_model(argv[0]);
    if (port == 0) port = free_port();
    bool gpu = !strcmp(device, "cuda") || (!strcmp(device, "auto") && pd_backend_has_cuda());
    const char *transport = kv_transport ? kv_transport : gpu ? "cuda-ipc" : "shm";
    const char *dev = gpu ? "cuda" : "cpu";
    char p_port[16], d_port[16], kv_port[16], r_port[16], kv_addr[64], d_url[64], p_url[64];
    child cs[3] = {{"prefill", 0, free_port()}, {"decode", 0, free_port()}, {"router", 0, port}};
    int kvp = free_port();
    snprintf(p_port, sizeof p_port, "%d", cs[0].port);
    snprintf(d_port, sizeof d_port, "%d", cs[1].port);
    snprintf(r_port, sizeof r_port, "%d", port);
    snprintf(kv_port, sizeof kv_port, "%d", kvp);
    snprintf(kv_addr, sizeof kv_addr, "127.0.0.1:%d", kvp);
    snprintf(d_url, sizeof d_url, "http://127.0.0.1:%d", cs[1].port);
    snprintf(p_url, sizeof p_url, "http://127.0.0.1:%d", cs[0].port);
    signal(SIGINT, on_sig);
    signal(SIGTERM, on_sig);
    signal(SIGPIPE, SIG_IGN);

    char *pa[16 + MAX_FWD] = {"pdserve", "serve", "--role", "prefill", "--model", (char *)model, "--device", (char *)dev,
                              "--port", p_port, "--kv-port", kv_port};
    char *da[20 + MAX_FWD] = {"pdserve", "serve", "--role", "decode", "--model", (char *)model, "--device", (char *)dev,
                              "--port", d_port, "--prefill", kv_addr, "--kv-transport", (char *)transport,
                              "--disagg-min-tokens", (char *)min_tokens};
    for (int i = 0; i < n_fwd; i++) pa[12 + i] = da[16 + i] = fwd[i];
    char *ra[12] = {"pdserve", "router", "--port", r_port, "--decode", d_url, "--prefill", p_url, NULL};
    for (int i = 0; i + 1 < n_fwd; i++)  // the router traces too (one file per process)
        if (!strcmp(fwd[i], "--trace-dir")) {
            ra[8] = "--trace-dir";
            ra[9] = fwd[i + 1];
            ra[10] = NULL;
            break;
        }
    char *const *args[3] = {pa, da, ra};
    int rc = 1;
    for (int i = 0; i < 3; i++) {
        cs[i].pid = spawn(args[i]);
        if (cs[i].pid < 0 || !wait_health(&cs[i], 120)) {
            fprintf(stderr, "pdserve run: the %s process did not become healthy\n", cs[i].name);
            goto out;
        }
    }
    printf("pdserve run: prefill worker %s (KV port %d), decode worker %s, router http://127.0.0.1:%d\n", p_url, kvp, d_url, port);
    const char *how = !strcmp(transport, "tcp")    ? "inline over the KV socket"
                      : !strcmp(transport, "nccl") ? "GPU to GPU through an NCCL communicator"
                      : gpu                        ? "GPU to GPU, no host copy"
                                                   : "shared memory, same host";
    printf("pdserve run: KV transport: %s (%s)\n", transport, how);
    char *body = NULL;
    const char *req = "{\"messages\":[{\"role\":\"user\",\"content\":\"Who was the father of Isaac?\"}],\"max_tokens\":32,\"temperature\":0}";
    int st = http_req(port, "POST", "/v1/chat/completions", req, &body, 120000);
    if (st != 200) {
        fprintf(stderr, "pdserve run: the sample request failed (HTTP %d): %s\n", st, body ? body : "");
        pd_free(body);
        goto out;
    }
    print_answer(body);
    pd_free(body);
    printf("\nServing on http://127.0.0.1:%d — try:\n  curl http://127.0.0.1:%d/v1/chat/completions -H 'Content-Type: application/json' \\\n"
           "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Who was the father of Isaac?\"}],\"max_tokens\":32}'\n",
           port, port);
    fflush(stdout);
    rc = 0;
    while (!exit_after && !g_stop) {
        int ws;
        pid_t dead = waitpid(-1, &ws, WNOHANG);
        for (int i = 0; i < 3 && dead > 0; i++)
            if (cs[i].pid == dead) {
                fprintf(stderr, "pdserve run: the %s process exited (status %d); stopping\n", cs[i].name,
                        WIFEXITED(ws) ? WEXITSTATUS(ws) : -WTERMSIG(ws));
                cs[i].pid = 0;
                rc = 1;
                g_stop = 1;
            }
        poll(NULL, 0, 200);
    }
out:
    stop_all(cs, 3);
    return rc;
}
