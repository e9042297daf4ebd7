// bench_handoff.c — `pdserve bench-handoff`: the disaggregated prefill → decode KV handoff, timed.
//
// Two engines in two processes (CUDA IPC handles cannot be opened by the exporting process):
//   child  — a PREFILL-role engine on --devices A, listening on a loopback KV port;
//   parent — a DECODE-role engine on --devices B that exports its KV pool once (cuda-ipc on GPUs,
//            shm on the CPU) and hands every prompt to the child (disagg_min_tokens 1).
// The child is forked before anything touches the device; it answers the parent over two pipes
// ('S' → its pd_engine_stats, 'Q' → quit), so the parent can read the prefill side's counters.
//
// For each prompt length (random token ids, never a prefix-cache hit): one warm-up request, then
// --reps requests with max_tokens 1, each submitted through pd_engine_submit and watched with
// pd_engine_poll. Reported per length (medians):
//   * KV bytes moved (2 x layers x tokens x row bytes) and the copy time of the KV itself: the
//     prefill engine's kv_export_copy_us_total delta (cuda-ipc: the engine thread's time to
//     enqueue each layer's copy + checksum on the backend's transfer stream plus the wait for
//     that stream after the forward pass — with layer-wise overlap (the default; PD_KV_OVERLAP=0
//     turns it off) most copies ran during the forward pass and are not in it; nccl (--transport nccl): layer-wise like cuda-ipc —
//     the engine thread's time to enqueue each layer's gather + checksum, announce it and post its
//     ncclSend, plus the wait after the forward pass for the transfer stream and for the sends to
//     complete (the decode side received them); with PD_KV_OVERLAP=0 every layer ships after the
//     forward pass and all of it is in the copy time), and the resulting GB/s;
//   * the decode side's handoff time (PREFILL_REQ sent → KV verified, kv_handoff_us_total delta);
//   * TTFT disaggregated: submit → first TOKEN event on the decode engine.
// Then the child quits, the decode engine is freed, and a colocated (BOTH-role) engine on device A
// runs the same lengths: TTFT colocated, and the ratio disaggregated / colocated.
// Any handoff that fell back to local prefill is reported and makes the exit code 1.
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd/cmd.h"
#include "engine/engine.h"
#include "xfer/auth.h"

// The two engines' shared KV secret: made before the fork, so both processes hold it (never on disk).
static char g_secret[65];

#define HB_MAX_LENS 16

typedef struct hb_opts {
    const char *model, *tokenizer, *json_path, *device;
    bool dummy;
    int lens[HB_MAX_LENS], n_lens;
    int ttft_tokens;  // 0: the longest prompt the model takes (max_model_len - 1)
    int dev_prefill, dev_decode;
    int reps, block_size, max_batched;
    double kv_gib;
    pd_kvw_transport transport;  // 0: cuda-ipc on GPUs, shm on the CPU
} hb_opts;

typedef struct hb_row {
    int tokens;
    double kv_bytes, copy_ms, handoff_ms, ttft_disagg_ms, ttft_coloc_ms;
    int n_fallbacks;
} hb_row;

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static bool write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        c += w, n -= (size_t)w;
    }
    return true;
}
static bool read_all(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r, n -= (size_t)r;
    }
    return true;
}

// The engine needs a tokenizer next to config.json; bench configs (bench/configs/*) have none. With
// --tokenizer, a temporary folder links the model's files and the tokenizer's.
static bool link_dir(const char *from, const char *to, bool skip_existing) {
    DIR *d = opendir(from);
    if (!d) return false;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char src[4096], dst[4096];
        snprintf(src, sizeof src, "%s/%s", from, de->d_name);
        snprintf(dst, sizeof dst, "%s/%s", to, de->d_name);
        if (skip_existing && access(dst, F_OK) == 0) continue;
        char abs[4096];
        if (!realpath(src, abs) || symlink(abs, dst)) {
            closedir(d);
            return false;
        }
    }
    closedir(d);
    return true;
}

static pd_engine_params base_params(const hb_opts *o, const char *dir, int device_id) {
    pd_engine_params p = pd_engine_params_default();
    p.model_dir = dir;
    p.device = o->device;
    p.device_id = device_id;
    p.dummy_weights = o->dummy;
    p.block_size = o->block_size;
    p.kv_cache_bytes = (size_t)(o->kv_gib * (double)(1ull << 30));
    p.max_num_batched_tokens = o->max_batched;
    p.kv_transport = o->transport ? o->transport : strcmp(o->device, "cpu") ? PD_KVW_TRANSPORT_CUDA_IPC : PD_KVW_TRANSPORT_SHM;
    p.disagg_min_tokens = 1;
    p.disagg_timeout_ms = 120000;
    p.kv_secret = g_secret;
    return p;
}

// The prefill worker (child process). Never returns.
static void child_main(const hb_opts *o, const char *dir, int cmd_fd, int resp_fd) {
    pd_engine_params p = base_params(o, dir, o->dev_prefill);
    p.role = PD_ROLE_PREFILL;
    p.kv_host = "127.0.0.1";
    pd_err err = {0};
    pd_engine *e = pd_engine_new(&p, &err);
    int32_t port = -1;
    if (!e) fprintf(stderr, "pdserve bench-handoff: prefill engine: %s\n", err.msg);
    else if (pd_engine_start(e) != PD_OK) fprintf(stderr, "pdserve bench-handoff: cannot start the prefill engine\n");
    else port = pd_engine_kv_port(e);
    write_all(resp_fd, &port, sizeof port);
    char c;
    while (port > 0 && read_all(cmd_fd, &c, 1) && c == 'S') {
        pd_engine_stats st;
        pd_engine_stats_get(e, &st);
        if (!write_all(resp_fd, &st, sizeof st)) break;
    }
    pd_engine_free(e);
    _exit(port > 0 ? 0 : 1);
}

typedef struct hb_child {
    pid_t pid;
    int cmd_fd, resp_fd;
} hb_child;

static bool child_stats(hb_child *ch, pd_engine_stats *st) {
    return write_all(ch->cmd_fd, "S", 1) && read_all(ch->resp_fd, st, sizeof *st);
}

// Submits one prompt (max_tokens 1) and waits for its FINISHED event. Returns the TTFT in ms
// (submit → first TOKEN event), or -1.
static double run_one(pd_engine *e, uint64_t id, const int32_t *prompt, int n) {
    pd_engine_request r = {.id = id, .prompt = prompt, .n_prompt = n, .max_tokens = 1, .ignore_eos = true,
                           .sampling = pd_sampling_params_default()};
    r.sampling.temperature = 0;
    pd_err err = {0};
    int64_t t0 = pd_time_us(), t_first = -1;
    r.arrival_us = t0;
    if (pd_engine_submit(e, &r, &err) != PD_OK) {
        fprintf(stderr, "pdserve bench-handoff: submit: %s\n", err.msg);
        return -1;
    }
    int64_t deadline = t0 + 300 * 1000000ll;
    bool done = false;
    while (!done && pd_time_us() < deadline) {
        struct pollfd pfd = {.fd = pd_engine_event_fd(e), .events = POLLIN};
        poll(&pfd, 1, 50);
        pd_engine_event ev[8];
        int k;
        while ((k = pd_engine_poll(e, ev, 8)) > 0)
            for (int i = 0; i < k; i++) {
                if (ev[i].id != id) continue;
                if (ev[i].kind == PD_EV_TOKEN && t_first < 0) t_first = pd_time_us();
                if (ev[i].kind == PD_EV_FINISHED) done = true;
            }
    }
    return done && t_first >= 0 ? (double)(t_first - t0) / 1000.0 : -1;
}

static void rand_prompt(int32_t *p, int n, int vocab, uint64_t seed) {
    pd_rng r;
    pd_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) p[i] = (int32_t)(pd_rng_next(&r) % (uint64_t)vocab);
}

static int64_t sum_fallbacks(const pd_engine_stats *s) {
    int64_t n = 0;
    for (int i = 0; i < PD_FALLBACK_N; i++) n += s->n_kv_fallbacks[i];
    return n;
}

// Disaggregated runs of one length; fills the row's handoff fields. false on a hard failure.
static bool run_disagg(const hb_opts *o, pd_engine *d, hb_child *ch, hb_row *row, uint64_t *next_id) {
    const pd_model_config *c = pd_engine_config(d);
    int n = row->tokens, total = 1 + o->reps;
    int32_t *prompt = pd_malloc(sizeof(int32_t) * (size_t)n);
    double ttft[64], copy[64], hand[64], bytes = 0;
    int k = 0;
    for (int rep = 0; rep < total && prompt; rep++) {
        pd_engine_stats p0, p1, d0, d1;
        if (!child_stats(ch, &p0)) break;
        pd_engine_stats_get(d, &d0);
        rand_prompt(prompt, n, c->vocab_size, 0x5eed0000ull + (uint64_t)n * 131 + (uint64_t)rep);
        double t = run_one(d, (*next_id)++, prompt, n);
        if (t < 0) break;
        // Stats are published after each engine step: wait until both sides counted this one.
        for (int i = 0; i < 400; i++) {
            pd_engine_stats_get(d, &d1);
            if (d1.n_kv_handoffs + sum_fallbacks(&d1) > d0.n_kv_handoffs + sum_fallbacks(&d0)) break;
            poll(NULL, 0, 5);
        }
        for (int i = 0; i < 400 && child_stats(ch, &p1); i++) {
            if (p1.n_kv_exports > p0.n_kv_exports || sum_fallbacks(&d1) > sum_fallbacks(&d0)) break;
            poll(NULL, 0, 5);
        }
        row->n_fallbacks += (int)(sum_fallbacks(&d1) - sum_fallbacks(&d0));
        if (rep == 0) continue;  // warm-up
        ttft[k] = t;
        copy[k] = (double)(p1.kv_export_copy_us_total - p0.kv_export_copy_us_total) / 1000.0;
        hand[k] = (double)(d1.kv_handoff_us_total - d0.kv_handoff_us_total) / 1000.0;
        bytes = (double)(p1.n_kv_export_bytes - p0.n_kv_export_bytes);
        k++;
    }
    pd_free(prompt);
    if (k < o->reps) return false;
    row->kv_bytes = bytes;
    row->copy_ms = median(copy, k);
    row->handoff_ms = median(hand, k);
    row->ttft_disagg_ms = median(ttft, k);
    return true;
}

static bool run_coloc(const hb_opts *o, pd_engine *e, hb_row *row, uint64_t *next_id) {
    int n = row->tokens;
    int32_t *prompt = pd_malloc(sizeof(int32_t) * (size_t)n);
    double ttft[64];
    int k = 0;
    for (int rep = 0; rep < 1 + o->reps && prompt; rep++) {
        rand_prompt(prompt, n, pd_engine_config(e)->vocab_size, 0xc01c0000ull + (uint64_t)n * 131 + (uint64_t)rep);
        double t = run_one(e, (*next_id)++, prompt, n);
        if (t < 0) break;
        if (rep > 0) ttft[k++] = t;
    }
    pd_free(prompt);
    if (k < o->reps) return false;
    row->ttft_coloc_ms = median(ttft, k);
    return true;
}

static void print_rows(const hb_opts *o, const hb_row *rows, int n, int ttft_tokens) {
    printf("\n%-8s %10s %10s %9s %12s %14s %14s %7s %9s\n", "tokens", "KV MB", "copy ms", "GB/s", "handoff ms",
           "TTFT disagg", "TTFT coloc", "ratio", "fallback");
    for (int i = 0; i < n; i++) {
        const hb_row *r = &rows[i];
        double gbs = r->copy_ms > 0 ? r->kv_bytes / (r->copy_ms * 1e-3) * 1e-9 : 0;
        printf("%-8d %10.1f %10.3f %9.1f %12.3f %14.2f %14.2f %6.3fx %9d%s\n", r->tokens, r->kv_bytes * 1e-6, r->copy_ms, gbs,
               r->handoff_ms, r->ttft_disagg_ms, r->ttft_coloc_ms,
               r->ttft_coloc_ms > 0 ? r->ttft_disagg_ms / r->ttft_coloc_ms : 0, r->n_fallbacks,
               r->tokens == ttft_tokens ? "   <- TTFT target 1.10x" : "");
    }
    (void)o;
}

static bool write_json(const hb_opts *o, const hb_row *rows, int n, const char *transport) {
    json_t *arr = json_array();
    for (int i = 0; i < n; i++) {
        const hb_row *r = &rows[i];
        json_array_append_new(
            arr, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i}", "tokens", r->tokens, "kv_bytes", r->kv_bytes,
                           "copy_ms", r->copy_ms, "copy_gbs", r->copy_ms > 0 ? r->kv_bytes / (r->copy_ms * 1e-3) * 1e-9 : 0.0,
                           "handoff_ms", r->handoff_ms, "ttft_disagg_ms", r->ttft_disagg_ms, "ttft_coloc_ms",
                           r->ttft_coloc_ms, "ttft_ratio", r->ttft_coloc_ms > 0 ? r->ttft_disagg_ms / r->ttft_coloc_ms : 0.0,
                           "fallbacks", r->n_fallbacks));
    }
    json_t *root = json_pack("{s:s, s:s, s:s, s:[i,i], s:i, s:o}", "model", o->model, "device", o->device, "transport",
                             transport, "devices", o->dev_prefill, o->dev_decode, "reps", o->reps, "rows", arr);
    int rc = json_dump_file(root, o->json_path, JSON_INDENT(2));
    json_decref(root);
    return rc == 0;
}

static int parse_opts(int argc, char **argv, hb_opts *o) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"load-format", required_argument, 0, 'l'}, {"tokens", required_argument, 0, 't'},
        {"devices", required_argument, 0, 'D'}, {"device", required_argument, 0, 'd'},      {"json", required_argument, 0, 'j'},
        {"reps", required_argument, 0, 'r'},    {"tokenizer", required_argument, 0, 'k'},   {"ttft-tokens", required_argument, 0, 'T'},
        {"kv-cache-gib", required_argument, 0, 'g'}, {"max-num-batched-tokens", required_argument, 0, 'b'},
        {"transport", required_argument, 0, 'x'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    *o = (hb_opts){.device = "cuda", .reps = 3, .block_size = 16, .max_batched = 8192, .kv_gib = 4.0, .dev_decode = 1,
                   .lens = {512, 2048, 7500}, .n_lens = 3};
    int c;
    long v;
    double f;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'x':
            if (!strcmp(optarg, "cuda-ipc")) o->transport = PD_KVW_TRANSPORT_CUDA_IPC;
            else if (!strcmp(optarg, "nccl")) o->transport = PD_KVW_TRANSPORT_NCCL;
            else if (!strcmp(optarg, "ucx")) o->transport = PD_KVW_TRANSPORT_UCX;
            else if (!strcmp(optarg, "shm")) o->transport = PD_KVW_TRANSPORT_SHM;
            else if (!strcmp(optarg, "tcp")) o->transport = PD_KVW_TRANSPORT_TCP;
            else return pd_cmd_usage_error("bench-handoff", "--transport is cuda-ipc, nccl, shm or tcp");
            break;
        case 'k': o->tokenizer = optarg; break;
        case 'j': o->json_path = optarg; break;
        case 'd': o->device = optarg; break;
        case 'l':
            if (strcmp(optarg, "dummy") && strcmp(optarg, "auto")) return pd_cmd_usage_error("bench-handoff", "--load-format is auto or dummy");
            o->dummy = !strcmp(optarg, "dummy");
            break;
        case 't': {
            o->n_lens = 0;
            for (char *s = optarg, *end; *s; s = *end ? end + 1 : end) {
                v = strtol(s, &end, 10);
                if (end == s || (*end && *end != ',') || v < 1 || o->n_lens >= HB_MAX_LENS)
                    return pd_cmd_usage_error("bench-handoff", "--tokens is a comma-separated list of positive lengths");
                o->lens[o->n_lens++] = (int)v;
            }
            break;
        }
        case 'D':
            if (sscanf(optarg, "%d,%d", &o->dev_prefill, &o->dev_decode) != 2 || o->dev_prefill < 0 || o->dev_decode < 0)
                return pd_cmd_usage_error("bench-handoff", "--devices is PREFILL,DECODE (two device ids)");
            break;
        case 'r':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > 63) return pd_cmd_usage_error("bench-handoff", "--reps is 1..63");
            o->reps = (int)v;
            break;
        case 'T':
            if (!pd_cmd_parse_int(optarg, &v) || v < 1) return pd_cmd_usage_error("bench-handoff", "--ttft-tokens must be positive");
            o->ttft_tokens = (int)v;
            break;
        case 'b':
            if (!pd_cmd_parse_int(optarg, &v) || v < 16) return pd_cmd_usage_error("bench-handoff", "--max-num-batched-tokens must be >= 16");
            o->max_batched = (int)v;
            break;
        case 'g':
            if (!pd_cmd_parse_float(optarg, &f) || f <= 0) return pd_cmd_usage_error("bench-handoff", "--kv-cache-gib must be positive");
            o->kv_gib = f;
            break;
        case 'h':
            printf("usage: pdserve bench-handoff --model DIR [--load-format dummy|auto] [--tokenizer DIR]\n"
                   "         [--tokens 512,2048,7500] [--ttft-tokens N] [--devices PREFILL,DECODE] [--device cuda|cpu]\n"
                   "         [--reps 3] [--kv-cache-gib 4] [--max-num-batched-tokens 8192] [--json FILE]\n"
                   "         [--transport cuda-ipc|nccl|shm|tcp] (default cuda-ipc on GPUs, shm on the CPU)\n");
            return 0;
        default: return 2;
        }
    }
    if (!o->model) return pd_cmd_usage_error("bench-handoff", "--model DIR is required");
    return -1;
}

// Prepares the model folder (linking a tokenizer in when asked); dir gets the folder to use.
static bool prepare_dir(const hb_opts *o, char *dir, size_t cap, char *tmp, size_t tmp_cap) {
    tmp[0] = 0;
    if (!o->tokenizer) {
        snprintf(dir, cap, "%s", o->model);
        return true;
    }
    snprintf(tmp, tmp_cap, "/tmp/pdserve-bench-handoff-XXXXXX");
    if (!mkdtemp(tmp)) return false;
    snprintf(dir, cap, "%s", tmp);
    return link_dir(o->model, tmp, false) && link_dir(o->tokenizer, tmp, true);
}

static void remove_dir(const char *tmp) {
    if (!tmp[0]) return;
    DIR *d = opendir(tmp);
    if (d) {
        struct dirent *de;
        char p[4096];
        while ((de = readdir(d)))
            if (de->d_name[0] != '.') snprintf(p, sizeof p, "%s/%s", tmp, de->d_name), unlink(p);
        closedir(d);
    }
    rmdir(tmp);
}

// The decode engine (this process), connected to the prefill worker at 127.0.0.1:port. NULL on failure.
static pd_engine *start_decode(const hb_opts *o, const char *dir, int32_t port) {
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", (int)port);
    pd_engine_params p = base_params(o, dir, o->dev_decode);
    p.role = PD_ROLE_DECODE;
    p.n_prefill_addrs = 1;
    p.prefill_addrs[0] = addr;
    pd_err err = {0};
    pd_engine *d = pd_engine_new(&p, &err);
    if (!d || pd_engine_start(d) != PD_OK) {
        fprintf(stderr, "pdserve bench-handoff: decode engine: %s\n", err.msg);
        pd_engine_free(d);
        return NULL;
    }
    for (int i = 0; i < 3000 && pd_engine_n_prefill_healthy(d) == 0; i++) poll(NULL, 0, 10);
    if (pd_engine_n_prefill_healthy(d) == 0) {
        fprintf(stderr, "pdserve bench-handoff: the decode engine never connected to the prefill engine\n");
        pd_engine_free(d);
        return NULL;
    }
    return d;
}

int pd_cmd_bench_handoff(int argc, char **argv) {
    hb_opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc >= 0) return prc;
    char dir[4096], tmp[256];
    if (!prepare_dir(&o, dir, sizeof dir, tmp, sizeof tmp)) {
        fprintf(stderr, "pdserve bench-handoff: cannot prepare a model folder with the tokenizer of %s\n", o.tokenizer);
        remove_dir(tmp);
        return 1;
    }
    uint8_t rnd[32];
    pd_auth_nonce(rnd);
    for (int i = 0; i < 32; i++) snprintf(g_secret + 2 * i, 3, "%02x", rnd[i]);
    // Fork first: the child must not inherit an initialised device context.
    int to_child[2], from_child[2];
    if (pipe(to_child) || pipe(from_child)) {
        fprintf(stderr, "pdserve bench-handoff: pipe: %s\n", strerror(errno));
        return 1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "pdserve bench-handoff: fork: %s\n", strerror(errno));
        return 1;
    }
    if (pid == 0) {
        close(to_child[1]), close(from_child[0]);
        child_main(&o, dir, to_child[0], from_child[1]);
    }
    close(to_child[0]), close(from_child[1]);
    hb_child ch = {.pid = pid, .cmd_fd = to_child[1], .resp_fd = from_child[0]};
    signal(SIGPIPE, SIG_IGN);
    int rc = 1, n_rows = 0;
    hb_row rows[HB_MAX_LENS + 1];
    memset(rows, 0, sizeof rows);
    pd_engine *d = NULL, *col = NULL;
    uint64_t next_id = 1;
    int32_t port = -1;
    if (!read_all(ch.resp_fd, &port, sizeof port) || port <= 0) {
        fprintf(stderr, "pdserve bench-handoff: the prefill engine did not start\n");
        goto done;
    }
    d = start_decode(&o, dir, port);
    if (!d) goto done;
    int max_len = pd_engine_max_model_len(d) - 1;
    int ttft_tokens = o.ttft_tokens > 0 ? PD_MIN(o.ttft_tokens, max_len) : max_len;
    for (int i = 0; i < o.n_lens; i++) rows[n_rows++].tokens = PD_MIN(o.lens[i], max_len);
    bool have = false;
    for (int i = 0; i < n_rows; i++) have |= rows[i].tokens == ttft_tokens;
    if (!have) rows[n_rows++].tokens = ttft_tokens;
    const char *transport = pd_kvw_transport_name(pd_engine_kv_transport(d));
    const char *ov = getenv("PD_KV_OVERLAP");
    bool overlap = !(ov && !strcmp(ov, "0"));
    printf("bench-handoff: model %s, %s devices prefill %d -> decode %d, transport %s, %d reps after 1 warm-up, "
           "layer-wise overlap %s (PD_KV_OVERLAP)\n", o.model, o.device, o.dev_prefill, o.dev_decode, transport, o.reps,
           overlap ? "on" : "off");
    for (int i = 0; i < n_rows; i++) {
        if (!run_disagg(&o, d, &ch, &rows[i], &next_id)) {
            fprintf(stderr, "pdserve bench-handoff: disaggregated run of %d tokens failed\n", rows[i].tokens);
            goto done;
        }
        printf("  disaggregated %5d tokens: TTFT %.2f ms, KV copy %.3f ms\n", rows[i].tokens, rows[i].ttft_disagg_ms,
               rows[i].copy_ms);
        fflush(stdout);
    }
    // Colocated reference on the prefill device, once the two workers are gone.
    write_all(ch.cmd_fd, "Q", 1);
    waitpid(ch.pid, NULL, 0);
    ch.pid = 0;
    pd_engine_free(d);
    d = NULL;
    pd_err err = {0};
    pd_engine_params p = base_params(&o, dir, o.dev_prefill);
    col = pd_engine_new(&p, &err);
    if (!col || pd_engine_start(col) != PD_OK) {
        fprintf(stderr, "pdserve bench-handoff: colocated engine: %s\n", err.msg);
        goto done;
    }
    for (int i = 0; i < n_rows; i++)
        if (!run_coloc(&o, col, &rows[i], &next_id)) {
            fprintf(stderr, "pdserve bench-handoff: colocated run of %d tokens failed\n", rows[i].tokens);
            goto done;
        }
    print_rows(&o, rows, n_rows, ttft_tokens);
    rc = 0;
    for (int i = 0; i < n_rows; i++)
        if (rows[i].n_fallbacks) {
            fprintf(stderr, "pdserve bench-handoff: %d handoff(s) of %d tokens fell back to local prefill\n", rows[i].n_fallbacks,
                    rows[i].tokens);
            rc = 1;
        }
    if (o.json_path && !write_json(&o, rows, n_rows, transport)) {
        fprintf(stderr, "pdserve bench-handoff: cannot write %s\n", o.json_path);
        rc = 1;
    }
done:
    pd_engine_free(col);
    pd_engine_free(d);
    if (ch.pid > 0) {
        write_all(ch.cmd_fd, "Q", 1);
        waitpid(ch.pid, NULL, 0);
    }
    close(ch.cmd_fd);
    close(ch.resp_fd);
    remove_dir(tmp);
    return rc;
}
