// run.c — `pdserve run`: the embedded default, and a small supervisor. On one machine it starts,
// as separate processes, one prefill worker, one decode worker and the router in front of them,
// waits until each answers /health, sends one sample chat request through the router (its prompt
// is long enough to be handed off), prints the answer and what happened to it (read from the
// decode worker's /metrics: handed off, how many KV bytes, how long; or prefilled locally and
// why), the URL and a curl example, then keeps serving until SIGINT/SIGTERM.
// `--colocated` runs the single-process server instead (serve.c).
//
// Supervision (like a tiny systemd unit set):
//   * the children are this same binary (/proc/self/exe) with `serve` / `router` arguments, in one
//     process group of their own (so a terminal's Ctrl-C reaches only this process, which stops
//     them in order), each with PR_SET_PDEATHSIG = SIGKILL: if this process dies, even by
//     SIGKILL, the kernel kills them (no orphan keeps its ports and memory);
//   * a child that dies while serving is logged and restarted on the same ports after a backoff
//     (0.5 s, doubling to 30 s; back to 0.5 s once a child has stayed up 30 s); the others keep
//     serving (the decode worker prefills locally while the prefill worker is away and reconnects
//     by itself; the router takes a dead worker out of rotation and back in). A child that keeps
//     dying within seconds of its start (10 times in a row) stops the whole group;
//   * workers listen on 127.0.0.1 only; `--host` applies to the router alone;
//   * `--threads N` (default: cores ÷ 2 compute processes) goes to each worker (OpenMP threads)
//     so the two workers do not oversubscribe the cores.
//
// Shutdown (SIGTERM or SIGINT, handled on the event loop through evsignal; also after
// --exit-after-sample): the router is sent SIGTERM first (it stops taking requests and lets the
// running ones finish within --shutdown-timeout), then, once it has exited, both workers (nothing
// is in flight through them any more). A second signal is passed on (children end what is still
// running at once); a child still alive --shutdown-timeout + 5 s after its SIGTERM gets SIGKILL.
// The exit status is 0 when every child exited cleanly.
#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "backend/backend.h"
#include "cmd/cmd.h"
#include "http/client.h"
#include "xfer/auth.h"

int pd_cmd_run_colocated(int argc, char **argv);  // serve.c

#define MAX_FWD 64
#define BACKOFF_MIN_MS 500
#define BACKOFF_MAX_MS 30000
#define STABLE_S 30        // a child up this long has its backoff reset
#define MAX_QUICK_FAILS 10 // consecutive deaths within STABLE_S of their start: give up
#define KILL_GRACE_S 5     // after --shutdown-timeout, before SIGKILL

enum { C_PREFILL, C_DECODE, C_ROUTER, N_CHILDREN };

struct run_ctx;

typedef struct child {
    struct run_ctx *r;
    const char *name;
    char **argv;           // NULL-terminated, borrowed
    int port;              // HTTP port
    pid_t pid;             // 0 = not running
    int64_t t_start_us;
    int backoff_ms;
    int n_restarts, n_quick_fails;
    struct event *restart; // backoff timer
    bool is_signalled;     // SIGTERM sent during shutdown
    bool is_clean;         // never started, or exited with status 0 (or by our SIGTERM)
} child;

typedef enum run_phase { PH_STARTING, PH_SERVING, PH_STOP_ROUTER, PH_STOP_WORKERS, PH_DONE } run_phase;

typedef struct run_ctx {
    struct event_base *base;
    child cs[N_CHILDREN];
    pid_t pgid;            // the children's process group (0 until the first child)
    const char *threads;   // --threads value for the workers
    int shutdown_timeout_s;
    run_phase phase;
    bool stop_requested;   // a signal came (during start-up: abandon it)
    int n_signals;
    bool is_failed;        // a child could not be kept up
    int64_t t_kill_us;     // shutdown: SIGKILL what is left at this time
    struct event *sigint, *sigterm, *sigchld, *tick;
} run_ctx;

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
    *body_out = NULL;
    return pd_http_fetch(&rq, timeout_ms, &status, body_out, NULL, NULL) == PD_OK ? status : 0;
}

// ---- children ----------------------------------------------------------------------------------

static pid_t spawn(run_ctx *r, child *c) {
    pid_t parent = getpid();
    // Signals stay blocked from fork to exec in the child: libevent's handlers (inherited until
    // exec) would write into *our* signal socketpair.
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    pid_t pid = fork();
    if (pid < 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        fprintf(stderr, "pdserve run: fork: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        // Die with the supervisor, even when it is SIGKILLed; if it died before prctl took
        // effect, we were re-parented already: leave at once.
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) || getppid() != parent) _exit(1);
        if (setpgid(0, r->pgid) && r->pgid) setpgid(0, 0);  // group gone (all died): a new one
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);  // exec keeps ignored signals ignored; serve sets its own
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (r->threads) {          // OpenMP / OpenBLAS read these when they load
            setenv("OMP_NUM_THREADS", r->threads, 1);
            setenv("OPENBLAS_NUM_THREADS", "1", 1);
        }
        execv("/proc/self/exe", c->argv);
        fprintf(stderr, "pdserve run: exec failed: %s\n", strerror(errno));
        _exit(127);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    // Both sides set the group (whichever runs first wins the race; the other call is a no-op or
    // fails harmlessly after exec).
    if (setpgid(pid, r->pgid) && r->pgid) setpgid(pid, pid);
    pid_t g = getpgid(pid);
    if (g > 0 && g != getpgrp()) r->pgid = g;
    c->pid = pid;
    c->is_clean = false;
    c->t_start_us = pd_time_us();
    return pid;
}

static child *child_of(run_ctx *r, pid_t pid) {
    for (int i = 0; i < N_CHILDREN; i++)
        if (r->cs[i].pid == pid) return &r->cs[i];
    return NULL;
}

static void describe_exit(int ws, char *buf, size_t n) {
    if (WIFEXITED(ws)) snprintf(buf, n, "exited with status %d", WEXITSTATUS(ws));
    else if (WIFSIGNALED(ws)) snprintf(buf, n, "was killed by signal %d (%s)", WTERMSIG(ws), strsignal(WTERMSIG(ws)));
    else snprintf(buf, n, "ended (wait status %d)", ws);
}

static void begin_shutdown(run_ctx *r);
static void advance_shutdown(run_ctx *r);

static void on_restart(evutil_socket_t fd, short what, void *arg) {
    child *c = arg;
    run_ctx *r = c->r;
    PD_UNUSED(fd);
    PD_UNUSED(what);
    if (r->phase != PH_SERVING) return;
    if (spawn(r, c) > 0) {
        c->n_restarts++;
        fprintf(stderr, "pdserve run: restarted the %s process (pid %d, restart %d)\n", c->name, (int)c->pid,
                c->n_restarts);
    } else {
        struct timeval tv = {c->backoff_ms / 1000, (c->backoff_ms % 1000) * 1000};
        event_add(c->restart, &tv);
    }
}

// A child died while serving: restart it after its backoff; the others keep serving.
static void schedule_restart(run_ctx *r, child *c, int ws) {
    char why[96];
    describe_exit(ws, why, sizeof why);
    double up_s = (double)(pd_time_us() - c->t_start_us) / 1e6;
    if (up_s >= STABLE_S) {
        c->backoff_ms = BACKOFF_MIN_MS;
        c->n_quick_fails = 0;
    } else {
        c->backoff_ms = c->n_quick_fails ? PD_MIN(c->backoff_ms * 2, BACKOFF_MAX_MS) : BACKOFF_MIN_MS;
        c->n_quick_fails++;
    }
    if (c->n_quick_fails > MAX_QUICK_FAILS) {
        fprintf(stderr, "pdserve run: the %s process %s after %.1f s, its %dth quick failure in a row; stopping\n",
                c->name, why, up_s, c->n_quick_fails);
        r->is_failed = true;
        begin_shutdown(r);
        return;
    }
    fprintf(stderr, "pdserve run: the %s process %s after %.1f s; restarting it in %.1f s (the others keep serving)\n",
            c->name, why, up_s, c->backoff_ms / 1000.0);
    struct timeval tv = {c->backoff_ms / 1000, (c->backoff_ms % 1000) * 1000};
    event_add(c->restart, &tv);
}

static void on_sigchld(evutil_socket_t fd, short what, void *arg) {
    run_ctx *r = arg;
    PD_UNUSED(fd);
    PD_UNUSED(what);
    int ws;
    pid_t pid;
    while ((pid = waitpid(-1, &ws, WNOHANG)) > 0) {
        child *c = child_of(r, pid);
        if (!c) continue;
        c->pid = 0;
        // A child still starting up has no handler yet: our SIGTERM's default action is its exit.
        c->is_clean = (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) ||
                      (c->is_signalled && WIFSIGNALED(ws) && WTERMSIG(ws) == SIGTERM);
        if (r->phase == PH_SERVING) {
            schedule_restart(r, c, ws);
        } else if (r->phase >= PH_STOP_ROUTER) {
            char why[96];
            describe_exit(ws, why, sizeof why);
            if (!c->is_clean) fprintf(stderr, "pdserve run: the %s process %s\n", c->name, why);
        }
    }
    if (r->phase >= PH_STOP_ROUTER) advance_shutdown(r);
}

static void term(child *c, int sig) {
    if (c->pid > 0) kill(c->pid, sig);
    c->is_signalled = true;
}

// Moves the ordered shutdown forward: router first, then the workers, then done.
static void advance_shutdown(run_ctx *r) {
    int64_t now = pd_time_us();
    int64_t grace = (int64_t)(r->shutdown_timeout_s + KILL_GRACE_S) * 1000000;
    if (r->phase == PH_STOP_ROUTER && r->cs[C_ROUTER].pid == 0) {
        r->phase = PH_STOP_WORKERS;
        term(&r->cs[C_DECODE], SIGTERM);
        term(&r->cs[C_PREFILL], SIGTERM);
        r->t_kill_us = now + grace;
    }
    if (r->phase == PH_STOP_WORKERS && r->cs[C_DECODE].pid == 0 && r->cs[C_PREFILL].pid == 0) {
        r->phase = PH_DONE;
        event_base_loopbreak(r->base);
        return;
    }
    if (now >= r->t_kill_us) {
        for (int i = 0; i < N_CHILDREN; i++)
            if (r->cs[i].pid > 0 && (r->phase == PH_STOP_WORKERS || i == C_ROUTER)) {
                fprintf(stderr, "pdserve run: the %s process did not stop in time; killing it\n", r->cs[i].name);
                kill(r->cs[i].pid, SIGKILL);
            }
        r->t_kill_us = now + 1000000;
    }
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    advance_shutdown(arg);
}

static void begin_shutdown(run_ctx *r) {
    for (int i = 0; i < N_CHILDREN; i++) event_del(r->cs[i].restart);
    if (r->phase >= PH_STOP_ROUTER) return;
    r->phase = PH_STOP_ROUTER;
    r->t_kill_us = pd_time_us() + (int64_t)(r->shutdown_timeout_s + KILL_GRACE_S) * 1000000;
    term(&r->cs[C_ROUTER], SIGTERM);
    struct timeval tv = {0, 100000};
    event_add(r->tick, &tv);
    advance_shutdown(r);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    run_ctx *r = arg;
    PD_UNUSED(what);
    const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    r->stop_requested = true;
    if (r->n_signals++ == 0) {
        if (r->phase == PH_STARTING) return;  // start-up notices and stops
        fprintf(stderr, "\npdserve run: caught %s: stopping the router (running requests get up to %d s), then the "
                        "workers; signal again to stop now\n", name, r->shutdown_timeout_s);
        begin_shutdown(r);
    } else if (r->n_signals == 2) {
        fprintf(stderr, "pdserve run: caught %s again: ending the running requests now\n", name);
        for (int i = 0; i < N_CHILDREN; i++) term(&r->cs[i], SIGTERM);  // a child's second signal ends it
        if (r->phase == PH_STOP_ROUTER) r->phase = PH_STOP_WORKERS;
    } else {
        fprintf(stderr, "pdserve run: caught %s a third time: killing the children\n", name);
        for (int i = 0; i < N_CHILDREN; i++) term(&r->cs[i], SIGKILL);
        if (r->phase < PH_STOP_WORKERS) r->phase = PH_STOP_WORKERS;
    }
}

// Start-up: polls c's /health until 200 (false when c exits, a signal comes or timeout_s pass).
// Signals and SIGCHLD are handled in between (one non-blocking loop pass per poll).
static bool wait_health(run_ctx *r, child *c, int timeout_s) {
    int64_t end = pd_time_us() + (int64_t)timeout_s * 1000000;
    while (pd_time_us() < end) {
        event_base_loop(r->base, EVLOOP_NONBLOCK);
        if (r->stop_requested) return false;
        if (c->pid == 0) {
            fprintf(stderr, "pdserve run: the %s process exited during start-up\n", c->name);
            return false;
        }
        char *b;
        int st = http_req(c->port, "GET", "/health", NULL, &b, 2000);
        pd_free(b);
        if (st == 200) return true;
        poll(NULL, 0, 50);
    }
    fprintf(stderr, "pdserve run: the %s process did not answer /health within %d s\n", c->name, timeout_s);
    return false;
}

// Stops whatever started, in order, with no serving phase (start-up failed or was interrupted).
static void stop_now(run_ctx *r) {
    r->phase = PH_SERVING;  // so begin_shutdown runs its course
    begin_shutdown(r);
    if (r->phase != PH_DONE) event_base_dispatch(r->base);
}

// ---- the sample request and its report ---------------------------------------------------------

// Sum of the samples of metric `name` (any labels) in a Prometheus text body.
static double metric_sum(const char *text, const char *name) {
    double s = 0;
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, name, n) || (p[n] != ' ' && p[n] != '{')) continue;
        const char *v = p[n] == '{' ? strchr(p, '}') : p + n;
        if (v) s += strtod(v + 1, NULL);
    }
    return s;
}

typedef struct kv_counters {
    double handoffs, bytes, seconds, local_short, fallbacks;
    bool ok;
} kv_counters;

static kv_counters read_kv_counters(int port) {
    kv_counters k = {0};
    char *b = NULL;
    if (http_req(port, "GET", "/metrics", NULL, &b, 5000) == 200 && b) {
        k.handoffs = metric_sum(b, "pdserve_kv_handoffs_total");
        k.bytes = metric_sum(b, "pdserve_kv_handoff_bytes_total");
        k.seconds = metric_sum(b, "pdserve_kv_handoff_seconds_total");
        k.local_short = metric_sum(b, "pdserve_kv_local_prefill_short_total");
        k.fallbacks = metric_sum(b, "pdserve_kv_handoff_fallbacks_total");
        k.ok = true;
    }
    pd_free(b);
    return k;
}

// Long enough (> 64 tokens with the chat template) to be handed to the prefill worker.
static const char SAMPLE_PROMPT[] =
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
    "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
    "God divided the light from the darkness. Who was the father of Isaac?";

// Sends the sample, prints the answer and what the decode worker's counters say happened.
static bool run_sample(run_ctx *r, const char *transport, const char *min_tokens) {
    kv_counters k0 = read_kv_counters(r->cs[C_DECODE].port);
    char req[1024];
    snprintf(req, sizeof req,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":32,\"temperature\":0}", SAMPLE_PROMPT);
    char *body = NULL;
    int64_t t0 = pd_time_us();
    int st = http_req(r->cs[C_ROUTER].port, "POST", "/v1/chat/completions", req, &body, 120000);
    double ms = (double)(pd_time_us() - t0) / 1e3;
    if (st != 200) {
        fprintf(stderr, "pdserve run: the sample request failed (HTTP %d): %s\n", st, body ? body : "");
        pd_free(body);
        return false;
    }
    json_t *o = json_loads(body, 0, NULL);
    pd_free(body);
    json_t *c = json_object_get(json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message"), "content");
    json_int_t n_prompt = json_integer_value(json_object_get(json_object_get(o, "usage"), "prompt_tokens"));
    printf("\nsample request (through the router): \"...Who was the father of Isaac?\" (%lld prompt tokens)\n"
           "answer: %s\n", (long long)n_prompt, json_is_string(c) ? json_string_value(c) : "?");
    json_decref(o);
    kv_counters k1 = read_kv_counters(r->cs[C_DECODE].port);
    if (!k0.ok || !k1.ok) {
        printf("pdserve run: (the decode worker's /metrics did not answer: no handoff report)\n");
    } else if (k1.handoffs > k0.handoffs) {
        printf("pdserve run: prefilled by the prefill worker; %.1f KiB of KV moved to the decode worker over %s, "
               "%.1f ms from KV request to verified KV (request total %.0f ms)\n",
               (k1.bytes - k0.bytes) / 1024.0, transport, (k1.seconds - k0.seconds) * 1e3, ms);
    } else if (k1.fallbacks > k0.fallbacks) {
        printf("pdserve run: the KV handoff failed (see pdserve_kv_handoff_fallbacks_total); the decode worker "
               "prefilled the prompt itself (request total %.0f ms)\n", ms);
    } else {
        printf("pdserve run: no handoff: the prompt's uncached part was below --disagg-min-tokens %s, so the decode "
               "worker prefilled it itself (request total %.0f ms)\n", min_tokens, ms);
    }
    return true;
}

// ---- flags and main ----------------------------------------------------------------------------

// The children's port arguments. argv entries point into these arrays, so rewriting them (a start-up
// retry on new ports) changes what the next spawn passes.
typedef struct run_ports {
    char p_port[16], d_port[16], kv_port[16], r_port[16], kv_addr[64], d_url[64], p_url[64];
} run_ports;

static void ports_format(run_ports *s, const run_ctx *r, int kv_port) {
    snprintf(s->p_port, sizeof s->p_port, "%d", r->cs[C_PREFILL].port);
    snprintf(s->d_port, sizeof s->d_port, "%d", r->cs[C_DECODE].port);
    snprintf(s->r_port, sizeof s->r_port, "%d", r->cs[C_ROUTER].port);
    snprintf(s->kv_port, sizeof s->kv_port, "%d", kv_port);
    snprintf(s->kv_addr, sizeof s->kv_addr, "127.0.0.1:%d", kv_port);
    snprintf(s->d_url, sizeof s->d_url, "http://127.0.0.1:%d", r->cs[C_DECODE].port);
    snprintf(s->p_url, sizeof s->p_url, "http://127.0.0.1:%d", r->cs[C_PREFILL].port);
}

static void usage(void) {
    printf("usage: pdserve run [--model DIR] [--host H] [--port P (default 8000; 0 = any free port)]\n"
           "                  [--device cpu|cuda|auto] [--threads N] [--shutdown-timeout S]\n"
           "                  [--disagg-min-tokens N] [--kv-transport tcp|shm|cuda-ipc|nccl]\n"
           "                  [--exit-after-sample] [--colocated] [serve options]\n"
           "  Starts a prefill worker, a decode worker and the router (separate processes, supervised:\n"
           "  a child that dies is restarted, all die with this process) with the bundled model,\n"
           "  answers a sample request through the router and says whether its KV was handed off, then\n"
           "  serves until SIGINT/SIGTERM (graceful: the router drains first, then the workers).\n"
           "  --host H      the router's address (workers always listen on 127.0.0.1)\n"
           "  --threads N   compute threads per worker (default: cores / 2)\n"
           "  --colocated   one process serving prefill and decode together instead\n"
           "  KV moves over shm on the CPU and cuda-ipc on a GPU unless --kv-transport says.\n"
           "  Other options (e.g. --num-kv-blocks N) are passed to both workers (see pdserve serve --help).\n");
}

int pd_cmd_run(int argc, char **argv) {
    const char *model = NULL, *device = "auto", *min_tokens = "64", *kv_transport = NULL, *host = NULL;
    const char *threads = NULL, *sdt = NULL;
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
    long v;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (!strcmp(a, "--exit-after-sample")) exit_after = true;
        else if (i + 1 < argc && !strcmp(a, "--model")) model = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--device")) device = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--host")) host = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--disagg-min-tokens")) min_tokens = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--threads")) {
            threads = argv[++i];
            if (!pd_cmd_parse_int(threads, &v) || v < 1 || v > 4096) return pd_cmd_usage_error("run", "--threads must be 1..4096");
        } else if (i + 1 < argc && !strcmp(a, "--shutdown-timeout")) {
            sdt = argv[++i];
            if (!pd_cmd_parse_int(sdt, &v) || v < 0 || v > 86400)
                return pd_cmd_usage_error("run", "--shutdown-timeout must be 0..86400 seconds");
        } else if (i + 1 < argc && !strcmp(a, "--kv-transport")) {
            kv_transport = argv[++i];
            if (strcmp(kv_transport, "tcp") && strcmp(kv_transport, "shm") && strcmp(kv_transport, "cuda-ipc") &&
                strcmp(kv_transport, "nccl"))
                return pd_cmd_usage_error("run", "--kv-transport must be tcp, shm, cuda-ipc or nccl");
        } else if (i + 1 < argc && !strcmp(a, "--port")) {
            if (!pd_cmd_parse_int(argv[++i], &v) || v < 0 || v > 65535) return pd_cmd_usage_error("run", "bad --port");
            port = (int)v;
        } else {
            if (n_fwd == MAX_FWD) return pd_cmd_usage_error("run", "too many options");
            fwd[n_fwd++] = argv[i];  // a serve option (or its value) for both workers
        }
    }
    if (!model) model = pd_cmd_default_model(argv[0]);
    bool port_auto = port == 0;
    if (port_auto) port = free_port();
    char threads_buf[24], sdt_buf[16];
    if (!threads) {  // the two workers share the cores; the router computes nothing
        long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
        snprintf(threads_buf, sizeof threads_buf, "%ld", PD_MAX(1L, n_cpu / 2));
        threads = threads_buf;
    }
    if (!sdt) {
        snprintf(sdt_buf, sizeof sdt_buf, "%d", PD_CMD_SHUTDOWN_TIMEOUT_S);
        sdt = sdt_buf;
    }
    bool gpu = !strcmp(device, "cuda") || (!strcmp(device, "auto") && pd_backend_has_cuda());
    const char *transport = kv_transport ? kv_transport : gpu ? "cuda-ipc" : "shm";
    const char *dev = gpu ? "cuda" : "cpu";
    run_ports ps;
    int kvp = free_port();
    run_ctx r = {0};
    r.threads = threads;
    r.shutdown_timeout_s = (int)strtol(sdt, NULL, 10);
    r.cs[C_PREFILL] = (child){.r = &r, .name = "prefill", .port = free_port(), .is_clean = true};
    r.cs[C_DECODE] = (child){.r = &r, .name = "decode", .port = free_port(), .is_clean = true};
    r.cs[C_ROUTER] = (child){.r = &r, .name = "router", .port = port, .is_clean = true};
    if (kvp <= 0 || r.cs[C_PREFILL].port <= 0 || r.cs[C_DECODE].port <= 0 || port <= 0) {
        fprintf(stderr, "pdserve run: cannot find free loopback ports\n");
        return 1;
    }
    ports_format(&ps, &r, kvp);

    // One fresh secret for the children (KV HMAC, router registration): 0600 in a private dir.
    char tok_dir[] = "/tmp/pdserve-run-XXXXXX", tok[64];
    pd_err terr = {0};
    if (!mkdtemp(tok_dir) || (snprintf(tok, sizeof tok, "%s/auth-token", tok_dir), pd_auth_write_new(tok, &terr))) {
        fprintf(stderr, "pdserve run: cannot create the auth token: %s\n", terr.msg[0] ? terr.msg : strerror(errno));
        return 1;
    }
    char *pa[26 + MAX_FWD] = {"pdserve", "serve", "--role", "prefill", "--model", (char *)model, "--device", (char *)dev,
                              "--host", "127.0.0.1", "--port", ps.p_port, "--kv-port", ps.kv_port, "--threads",
                              (char *)threads, "--shutdown-timeout", (char *)sdt, "--auth-token-file", tok};
    char *da[30 + MAX_FWD] = {"pdserve", "serve", "--role", "decode", "--model", (char *)model, "--device", (char *)dev,
                              "--host", "127.0.0.1", "--port", ps.d_port, "--prefill", ps.kv_addr, "--kv-transport",
                              (char *)transport, "--disagg-min-tokens", (char *)min_tokens, "--threads", (char *)threads,
                              "--shutdown-timeout", (char *)sdt, "--auth-token-file", tok};
    for (int i = 0; i < n_fwd; i++) pa[20 + i] = da[24 + i] = fwd[i];
    char *ra[18] = {"pdserve", "router", "--host", (char *)(host ? host : "127.0.0.1"), "--port", ps.r_port,
                    "--decode", ps.d_url, "--prefill", ps.p_url, "--shutdown-timeout", (char *)sdt,
                    "--auth-token-file", tok, NULL};
    for (int i = 0; i + 1 < n_fwd; i++)  // the router traces too (one file per process)
        if (!strcmp(fwd[i], "--trace-dir")) {
            ra[14] = "--trace-dir";
            ra[15] = fwd[i + 1];
            ra[16] = NULL;
            break;
        }
    r.cs[C_PREFILL].argv = pa;
    r.cs[C_DECODE].argv = da;
    r.cs[C_ROUTER].argv = ra;

    signal(SIGPIPE, SIG_IGN);
    int rc = 1;
    r.base = event_base_new();
    if (!r.base) return 1;
    r.sigint = evsignal_new(r.base, SIGINT, on_signal, &r);
    r.sigterm = evsignal_new(r.base, SIGTERM, on_signal, &r);
    r.sigchld = evsignal_new(r.base, SIGCHLD, on_sigchld, &r);
    r.tick = event_new(r.base, -1, EV_PERSIST, on_tick, &r);
    bool ok = r.sigint && r.sigterm && r.sigchld && r.tick && !event_add(r.sigint, NULL) &&
              !event_add(r.sigterm, NULL) && !event_add(r.sigchld, NULL);
    for (int i = 0; i < N_CHILDREN && ok; i++) ok = (r.cs[i].restart = evtimer_new(r.base, on_restart, &r.cs[i])) != NULL;
    if (!ok) {
        fprintf(stderr, "pdserve run: cannot set up the event loop\n");
        goto out;
    }

    for (int i = 0, n_tries = 0; i < N_CHILDREN; i++) {
        if (spawn(&r, &r.cs[i]) > 0 && wait_health(&r, &r.cs[i], 120)) continue;
        // A child that exited at once may have lost its port to another process between
        // free_port() and its bind: a few retries on new ports (not for a --port the user chose).
        bool can_retry = !r.stop_requested && r.cs[i].pid == 0 && ++n_tries < 4 && (i != C_ROUTER || port_auto);
        if (can_retry) {
            int k = free_port(), h = free_port();
            if (k > 0 && h > 0) {
                r.cs[i].port = h;
                if (i == C_PREFILL) kvp = k;
                if (i == C_ROUTER) port = h;
                ports_format(&ps, &r, kvp);
                fprintf(stderr, "pdserve run: starting the %s process again on new ports\n", r.cs[i].name);
                i--;
                continue;
            }
        }
        if (!r.stop_requested) fprintf(stderr, "pdserve run: the %s process did not become healthy\n", r.cs[i].name);
        stop_now(&r);
        if (r.stop_requested) goto stopped;  // interrupted by the user, not a failure
        goto out;
    }
    const char *shown = host && strcmp(host, "0.0.0.0") ? host : "127.0.0.1";
    printf("pdserve run: prefill worker %s (KV port %d), decode worker %s, router http://%s:%d; %s compute "
           "thread(s) per worker\n", ps.p_url, kvp, ps.d_url, host ? host : "127.0.0.1", port, threads);
    const char *how = !strcmp(transport, "tcp")    ? "inline over the KV socket"
                      : !strcmp(transport, "nccl") ? "GPU to GPU through an NCCL communicator"
                      : gpu                        ? "GPU to GPU, no host copy"
                                                   : "shared memory, same host";
    printf("pdserve run: prompts of %s+ uncached tokens are prefilled by the prefill worker; KV transport %s (%s)\n",
           min_tokens, transport, how);
    fflush(stdout);
    r.phase = PH_SERVING;
    if (!run_sample(&r, transport, min_tokens)) {
        stop_now(&r);
        goto out;
    }
    printf("\nServing on http://%s:%d (Ctrl-C to stop) — try:\n"
           "  curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' \\\n"
           "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Who was the father of Isaac?\"}],\"max_tokens\":32}'\n",
           shown, port, shown, port);
    fflush(stdout);
    event_base_loop(r.base, EVLOOP_NONBLOCK);  // signals or deaths during the sample
    if (exit_after || r.stop_requested) begin_shutdown(&r);
    if (r.phase != PH_DONE) event_base_dispatch(r.base);
stopped:
    rc = r.is_failed ? 1 : 0;
    for (int i = 0; i < N_CHILDREN; i++)
        if (!r.cs[i].is_clean) rc = 1;
    if (rc == 0) fprintf(stderr, "pdserve run: stopped\n");
out:
    for (int i = 0; i < N_CHILDREN; i++) {  // never leave a child behind
        if (r.cs[i].pid > 0) {
            kill(r.cs[i].pid, SIGKILL);
            waitpid(r.cs[i].pid, NULL, 0);
        }
        if (r.cs[i].restart) event_free(r.cs[i].restart);
    }
    if (r.sigint) event_free(r.sigint);
    if (r.sigterm) event_free(r.sigterm);
    if (r.sigchld) event_free(r.sigchld);
    if (r.tick) event_free(r.tick);
    event_base_free(r.base);
    unlink(tok);
    rmdir(tok_dir);
    return rc;
}
