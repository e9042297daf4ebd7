// serve.c — `pdserve serve` (the OpenAI-compatible server) and `pdserve run` (the embedded
// default: the bundled model on port 8000, answering one sample request through its own HTTP API
// before it keeps serving).
//
// Both: flags → pd_engine_params → pd_engine_new + pd_engine_start → one libevent loop on the
// main thread running pd_api → SIGTERM/SIGINT: graceful shutdown (shutdown.c): /health says
// "draining", new requests get 503 + Retry-After, running ones finish within --shutdown-timeout
// (then end with an SSE error event), the router registration is withdrawn, everything is freed
// and the exit status is 0.
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <getopt.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics/trace.h"
#include "api/api.h"
#include "cmd/cmd.h"
#include "engine/engine.h"
#include "http/client.h"
#include "spec/spec.h"
#include "wire/control.h"
#include "control/control.h"
#include "xfer/auth.h"

typedef struct serve_opts {
    pd_engine_params ep;
    pd_api_params ap;
    bool is_run;           // `run`: send the sample request
    bool exit_after_sample;
    int sample_max_tokens;
    const char *router_url;       // --router: register with this router (and deregister at exit)
    const char *router_token_file;
    const char *auth_token_file;  // --auth-token-file: the KV connections' shared secret (and the
                                  // router registration token when --router-token-file is absent)
    const char *advertise_url;    // the URL the router should use for us (default http://host:port)
    const char *trace_dir;        // --trace-dir: Chrome trace files of request spans (metrics/trace.h)
    bool spec_method_set;         // --speculative-method was given
    int shutdown_timeout_s;       // --shutdown-timeout
    const char *control_url;      // --control nats://HOST:PORT: presence + KV events over NATS
    const char *control_nkey_seed;  // --control-nkey-seed FILE: NATS nkey auth instead of the token
    int control_heartbeat_ms;     // --control-heartbeat-ms (default 200)
    bool link_aware_set;          // --disagg-link-aware given (else: on with --control, off without)
    bool prefill_queue;           // --prefill-queue: remote prefills through the JetStream work queue
    int debug_job_hold_ms;        // test hook: a prefill worker holds each fetched job this long before claiming it
} serve_opts;

// "123", "64k", "512M", "2G" (binary multiples; an optional trailing "B"/"iB"). false on error.
static bool parse_bytes(const char *s, size_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v >= 0)) return false;
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return false;
    *out = (size_t)(v * mul);
    return true;
}

static void serve_usage(bool is_run) {
    if (is_run)
        printf("usage: pdserve run [--model DIR] [--host H] [--port P (default 8000)] [serve options]\n"
               "  starts the server with the bundled model, answers a sample chat request through its own\n"
               "  HTTP API, prints the answer, the URL and a curl example, then serves until Ctrl-C.\n"
               "  --exit-after-sample   stop after the sample answer (for tests)\n\n");
    printf("usage: pdserve serve --model DIR [options]\n"
           "  --host H                      address to bind (default 127.0.0.1)\n"
           "  --port P                      TCP port (default 8000; 0 = any free port, printed)\n"
           "  --device cpu|cuda|cuda:N|auto (default auto)\n"
           "  --block-size N                tokens per KV block (default 16)\n"
           "  --num-kv-blocks N             KV cache size in blocks\n"
           "  --kv-cache-memory BYTES       KV cache size in bytes (k/M/G suffixes)\n"
           "  --kv-cache-dtype auto|fp8     KV cache format: the activation dtype, or E4M3 with per-head scales\n"
           "  --max-num-seqs N              running sequences per step\n"
           "  --max-num-batched-tokens N    token budget per step (default 2048)\n"
           "  --no-prefix-caching           disable automatic prefix caching\n"
           "  --no-chunked-prefill          prefill whole prompts only\n"
           "  --policy fcfs|srpt            scheduling policy (default fcfs)\n"
           "  --max-model-len N             context length (default: the model's)\n"
           "  --served-model-name NAME      model name clients must use (default: folder name)\n"
           "  --load-format dummy           random weights (benchmarking)\n"
           "  --max-waiting N               waiting-queue limit; beyond it requests get 503\n"
           "  --max-body-bytes BYTES        request body limit (default 8M; larger bodies get 413)\n"
           "  --max-connections N           open HTTP connections at most (default: fd limit less 1/8);\n"
           "                                at the limit the longest-idle ones are closed\n"
           "  --keepalive-timeout S         close idle keep-alive connections after S s (default 30)\n"
           "  --header-timeout S            a request must arrive whole within S s of its first bytes (60)\n"
           "  --trace-dir DIR               write request spans as Chrome trace JSON (Perfetto) into DIR\n"
           "  --threads N                   compute threads (CPU; default: every core)\n"
           "  --shutdown-timeout S          on SIGTERM/SIGINT: stop taking requests (503, /health \"draining\")\n"
           "                                and give running ones up to S seconds (default 30)\n"
           "disaggregated prefill/decode (docs/design.md):\n"
           "  --role both|prefill|decode    (default both: colocated)\n"
           "  --kv-host H  --kv-port P      prefill role: where the KV port listens (P 0 = any, printed)\n"
           "  --prefill HOST:PORT           decode role: a prefill worker's KV port (repeatable, up to 16)\n"
           "  --kv-transport tcp|shm|cuda-ipc|nccl|ucx  decode role (default shm on cpu, cuda-ipc on cuda)\n"
           "  --disagg-min-tokens N         prefill locally below N uncached prompt tokens (default 64)\n"
           "  --disagg-timeout-ms N         fall back to local prefill after N ms (default 30000)\n"
           "  --disagg-link-aware on|off    decide local vs remote prefill with the link model (default: on\n"
           "                                with --control, off without: the length threshold alone):\n"
           "                                predicted local prefill (step-time model) against queue + remote\n"
           "                                prefill + transfer over each prefill link (measured)\n"
           "  --auth-token-file F           shared secret (mode 0600) every KV connection proves (HMAC);\n"
           "                                required for --role prefill and --role decode\n"
           "  --debug-corrupt-kv N          test hook: corrupt every Nth KV transfer (prefill role)\n"
           "  --debug-kv-pause STEP         test hook: stop at hello_ack|mid_slab|before_done (prefill role)\n"
           "  --debug-refuse-kv-pool        test hook: refuse every decode worker's KV pool (prefill role)\n"
           "KV tiers below the device pool (docs/design.md \"KV tiers\"; cpu and cuda backends):\n"
           "  --kv-offload-dram SIZE        host DRAM tier: full blocks are written back here\n"
           "  --kv-offload-disk DIR         local disk tier (io_uring, O_DIRECT); persists across restarts\n"
           "  --kv-offload-disk-size SIZE   its capacity (required with --kv-offload-disk)\n"
           "  --kv-remote redis://HOST:PORT a Redis KV pool shared by every worker of the model\n"
           "  --kv-offload-dtype bf16|fp8|int8|f32  disk and Redis pages (default f32: lossless; per-head scales)\n"
           "speculative decoding (roles both and decode; exact: greedy output is unchanged):\n"
           "  --speculative-method M        none (default), draft, ngram (prompt lookup) or lookahead (Jacobi + n-gram pool)\n"
           "  --speculative-model DIR       draft model (same tokenizer as --model); implies --speculative-method draft\n"
           "  --num-speculative-tokens K    draft tokens per step at most (default 4, 1..16)\n"
           "  --speculative-fixed           always draft K (default: adaptive length from measured step costs and acceptance)\n"
           "  --ngram-max N                 ngram: longest suffix matched (default 3)\n"
           "  --lookahead-window W          lookahead: Jacobi window (default 8); --lookahead-ngram N: n-gram size (default 4)\n"
           "router registration:\n"
           "  --router URL                  register with the router at URL (re-sent every 10 s; deregistered at exit)\n"
           "  --router-token-file F         bearer token for the router's /internal/register\n"
           "  --advertise-url URL           the URL the router should use (default http://HOST:PORT)\n"
           "cluster mode:\n"
           "  --control nats://HOST:PORT    publish presence (role, capacity, load, KV events, link model) on NATS\n"
           "                                every heartbeat instead of being polled; the connection presents the\n"
           "                                --auth-token-file token (required: it also signs every message)\n"
           "  --control-nkey-seed FILE      authenticate to NATS with this nkey user seed (pdserve nkey-gen; the\n"
           "                                server lists its public key) instead of presenting the token\n"
           "  --control-heartbeat-ms N      presence period (default 200)\n"
           "  --prefill-queue               with --control: decode workers enqueue remote prefills on the JetStream\n"
           "                                work queue (stream PDSERVE_PREFILL), prefill workers pull, claim and ack;\n"
           "                                a job its prefill worker did not ack is redelivered (nats-server -js)\n"
           "  --debug-prefill-job-hold-ms N test hook (prefill role): hold each fetched job N ms before claiming it\n");
}

// Parses argv into o. Returns -1 on success, else the exit code (0 for --help).
static int parse_flags(int argc, char **argv, serve_opts *o) {
    enum { O_MODEL = 1, O_HOST, O_PORT, O_DEV, O_BS, O_NB, O_KVMEM, O_SEQS, O_TOKS, O_NOPC, O_NOCP, O_POL, O_MML,
           O_NAME, O_LF, O_WAIT, O_BODY, O_EXIT, O_ROLE, O_KVHOST, O_KVPORT, O_PREFILL, O_KVTR, O_DMIN, O_DTO,
           O_CORRUPT, O_ROUTER, O_RTOKEN, O_ADV, O_SPEC_MODEL, O_SPEC_K, O_SPEC_METHOD, O_SPEC_FIXED, O_LA_W, O_LA_N,
           O_NGRAM_MAX, O_THREADS, O_SDT, O_MAXCONN, O_KATO, O_HDRTO, O_TRACE, O_AUTH, O_KVPAUSE, O_KVDT,
           O_OFF_DRAM, O_OFF_DISK, O_OFF_DISK_SIZE, O_OFF_REMOTE, O_OFF_DTYPE, O_REFUSE, O_CTL, O_CTLHB, O_CTLNKEY,
           O_LINK, O_PQ, O_JOBHOLD, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"host", required_argument, 0, O_HOST},
        {"port", required_argument, 0, O_PORT}, {"device", required_argument, 0, O_DEV},
        {"block-size", required_argument, 0, O_BS}, {"num-kv-blocks", required_argument, 0, O_NB},
        {"kv-cache-memory", required_argument, 0, O_KVMEM}, {"max-num-seqs", required_argument, 0, O_SEQS},
        {"max-num-batched-tokens", required_argument, 0, O_TOKS}, {"no-prefix-caching", no_argument, 0, O_NOPC},
        {"no-chunked-prefill", no_argument, 0, O_NOCP}, {"policy", required_argument, 0, O_POL},
        {"max-model-len", required_argument, 0, O_MML}, {"served-model-name", required_argument, 0, O_NAME},
        {"load-format", required_argument, 0, O_LF}, {"max-waiting", required_argument, 0, O_WAIT},
        {"max-body-bytes", required_argument, 0, O_BODY}, {"exit-after-sample", no_argument, 0, O_EXIT},
        {"role", required_argument, 0, O_ROLE}, {"kv-host", required_argument, 0, O_KVHOST},
        {"kv-port", required_argument, 0, O_KVPORT}, {"prefill", required_argument, 0, O_PREFILL},
        {"kv-transport", required_argument, 0, O_KVTR}, {"disagg-min-tokens", required_argument, 0, O_DMIN},
        {"disagg-timeout-ms", required_argument, 0, O_DTO}, {"debug-corrupt-kv", required_argument, 0, O_CORRUPT},
        {"router", required_argument, 0, O_ROUTER}, {"router-token-file", required_argument, 0, O_RTOKEN},
        {"advertise-url", required_argument, 0, O_ADV}, {"max-connections", required_argument, 0, O_MAXCONN},
        {"keepalive-timeout", required_argument, 0, O_KATO}, {"header-timeout", required_argument, 0, O_HDRTO},
        {"trace-dir", required_argument, 0, O_TRACE},
        {"speculative-model", required_argument, 0, O_SPEC_MODEL}, {"num-speculative-tokens", required_argument, 0, O_SPEC_K},
        {"speculative-method", required_argument, 0, O_SPEC_METHOD}, {"speculative-fixed", no_argument, 0, O_SPEC_FIXED},
        {"lookahead-window", required_argument, 0, O_LA_W}, {"lookahead-ngram", required_argument, 0, O_LA_N},
        {"ngram-max", required_argument, 0, O_NGRAM_MAX},
        {"threads", required_argument, 0, O_THREADS}, {"shutdown-timeout", required_argument, 0, O_SDT},
        {"auth-token-file", required_argument, 0, O_AUTH}, {"debug-kv-pause", required_argument, 0, O_KVPAUSE},
        {"debug-refuse-kv-pool", no_argument, 0, O_REFUSE},
        {"kv-cache-dtype", required_argument, 0, O_KVDT},
        {"kv-offload-dram", required_argument, 0, O_OFF_DRAM}, {"kv-offload-disk", required_argument, 0, O_OFF_DISK},
        {"kv-offload-disk-size", required_argument, 0, O_OFF_DISK_SIZE}, {"kv-remote", required_argument, 0, O_OFF_REMOTE},
        {"kv-offload-dtype", required_argument, 0, O_OFF_DTYPE},
        {"control", required_argument, 0, O_CTL}, {"control-nkey-seed", required_argument, 0, O_CTLNKEY},
        {"control-heartbeat-ms", required_argument, 0, O_CTLHB}, {"disagg-link-aware", required_argument, 0, O_LINK},
        {"prefill-queue", no_argument, 0, O_PQ}, {"debug-prefill-job-hold-ms", required_argument, 0, O_JOBHOLD},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0}};
    const char *cmd = o->is_run ? "run" : "serve";
    long v;
    size_t bytes;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        bool int_flag = c == O_PORT || c == O_BS || c == O_NB || c == O_SEQS || c == O_TOKS || c == O_MML || c == O_WAIT ||
                        c == O_KVPORT || c == O_DMIN || c == O_DTO || c == O_CORRUPT || c == O_SPEC_K || c == O_LA_W ||
                        c == O_LA_N || c == O_NGRAM_MAX || c == O_THREADS || c == O_SDT || c == O_MAXCONN || c == O_KATO ||
                        c == O_HDRTO;
        if (int_flag && (!pd_cmd_parse_int(optarg, &v) || v < 0 || v > (1l << 30)))
            return pd_cmd_usage_error(cmd, "bad value '%s' for an integer option", optarg);
        switch (c) {
        case O_MODEL: o->ep.model_dir = optarg; break;
        case O_HOST: o->ap.host = optarg; break;
        case O_PORT:
            if (v > 65535) return pd_cmd_usage_error(cmd, "--port must be 0..65535");
            o->ap.port = (int)v;
            break;
        case O_DEV:
            // "cuda:N" picks GPU N (all GPUs stay visible, so CUDA IPC can reach a peer GPU's pool).
            if (!strncmp(optarg, "cuda:", 5)) {
                long id;
                if (!pd_cmd_parse_int(optarg + 5, &id) || id < 0 || id > 1023) return pd_cmd_usage_error(cmd, "bad --device '%s'", optarg);
                o->ep.device = "cuda";
                o->ep.device_id = (int)id;
            } else {
                o->ep.device = optarg;
            }
            break;
        case O_BS: o->ep.block_size = (int)v; break;
        case O_NB: o->ep.n_blocks = (int)v; break;
        case O_KVMEM:
            if (!parse_bytes(optarg, &bytes)) return pd_cmd_usage_error(cmd, "bad --kv-cache-memory '%s'", optarg);
            o->ep.kv_cache_bytes = bytes;
            break;
        case O_SEQS: o->ep.max_num_seqs = (int)v; break;
        case O_TOKS: o->ep.max_num_batched_tokens = (int)v; break;
        case O_NOPC: o->ep.enable_prefix_caching = false; break;
        case O_NOCP: o->ep.enable_chunked_prefill = false; break;
        case O_POL:
            if (!strcmp(optarg, "fcfs")) o->ep.policy = PD_POLICY_FCFS;
            else if (!strcmp(optarg, "srpt")) o->ep.policy = PD_POLICY_SRPT;
            else return pd_cmd_usage_error(cmd, "--policy must be fcfs or srpt");
            break;
        case O_MML: o->ep.max_model_len = (int)v; break;
        case O_NAME: o->ap.served_model_name = optarg; break;
        case O_LF:
            if (strcmp(optarg, "dummy") && strcmp(optarg, "auto") && strcmp(optarg, "safetensors"))
                return pd_cmd_usage_error(cmd, "--load-format must be auto, safetensors or dummy");
            o->ep.dummy_weights = !strcmp(optarg, "dummy");
            break;
        case O_WAIT: o->ep.max_waiting = (int)v; break;
        case O_BODY:
            if (!parse_bytes(optarg, &bytes) || !bytes) return pd_cmd_usage_error(cmd, "bad --max-body-bytes '%s'", optarg);
            o->ap.max_body_bytes = bytes;
            break;
        case O_EXIT: o->exit_after_sample = true; break;
        case O_ROLE:
            if (!strcmp(optarg, "both")) o->ep.role = PD_ROLE_BOTH;
            else if (!strcmp(optarg, "prefill")) o->ep.role = PD_ROLE_PREFILL;
            else if (!strcmp(optarg, "decode")) o->ep.role = PD_ROLE_DECODE;
            else return pd_cmd_usage_error(cmd, "--role must be both, prefill or decode");
            break;
        case O_KVHOST: o->ep.kv_host = optarg; break;
        case O_KVPORT:
            if (v > 65535) return pd_cmd_usage_error(cmd, "--kv-port must be 0..65535");
            o->ep.kv_port = (int)v;
            break;
        case O_PREFILL:
            if (o->ep.n_prefill_addrs >= (int)PD_ARRAY_LEN(o->ep.prefill_addrs))
                return pd_cmd_usage_error(cmd, "at most %d --prefill workers", (int)PD_ARRAY_LEN(o->ep.prefill_addrs));
            if (!strchr(optarg, ':')) return pd_cmd_usage_error(cmd, "--prefill wants HOST:PORT, got '%s'", optarg);
            o->ep.prefill_addrs[o->ep.n_prefill_addrs++] = optarg;
            break;
        case O_KVTR:
            if (!strcmp(optarg, "tcp")) o->ep.kv_transport = PD_KVW_TRANSPORT_TCP;
            else if (!strcmp(optarg, "shm")) o->ep.kv_transport = PD_KVW_TRANSPORT_SHM;
            else if (!strcmp(optarg, "cuda-ipc")) o->ep.kv_transport = PD_KVW_TRANSPORT_CUDA_IPC;
            else if (!strcmp(optarg, "nccl")) o->ep.kv_transport = PD_KVW_TRANSPORT_NCCL;
            else if (!strcmp(optarg, "ucx")) o->ep.kv_transport = PD_KVW_TRANSPORT_UCX;
            else return pd_cmd_usage_error(cmd, "--kv-transport must be tcp, shm, cuda-ipc or nccl");
            break;
        case O_DMIN: o->ep.disagg_min_tokens = (int)v; break;
        case O_DTO: o->ep.disagg_timeout_ms = (int)v; break;
        case O_CORRUPT: o->ep.debug_corrupt_every = (int)v; break;
        case O_ROUTER: o->router_url = optarg; break;
        case O_RTOKEN: o->router_token_file = optarg; break;
        case O_ADV: o->advertise_url = optarg; break;
        case O_AUTH: o->auth_token_file = optarg; break;
        case O_REFUSE: o->ep.debug_refuse_kv_pools = true; break;
        case O_CTL:
            if (strncmp(optarg, "nats://", 7)) return pd_cmd_usage_error(cmd, "--control must be nats://HOST:PORT");
            o->control_url = optarg;
            break;
        case O_CTLNKEY: o->control_nkey_seed = optarg; break;
        case O_CTLHB:
            if (!pd_cmd_parse_int(optarg, &v) || v < 10 || v > 60000)
                return pd_cmd_usage_error(cmd, "--control-heartbeat-ms must be 10..60000");
            o->control_heartbeat_ms = (int)v;
            break;
        case O_PQ: o->prefill_queue = true; break;
        case O_JOBHOLD:
            if (!pd_cmd_parse_int(optarg, &v) || v < 0 || v > 600000)
                return pd_cmd_usage_error(cmd, "--debug-prefill-job-hold-ms must be 0..600000");
            o->debug_job_hold_ms = (int)v;
            break;
        case O_LINK:
            if (strcmp(optarg, "on") && strcmp(optarg, "off")) return pd_cmd_usage_error(cmd, "--disagg-link-aware must be on or off");
            o->ep.disagg_link_aware = !strcmp(optarg, "on");
            o->link_aware_set = true;
            break;
        case O_KVPAUSE:
            if (strcmp(optarg, "hello_ack") && strcmp(optarg, "mid_slab") && strcmp(optarg, "before_done"))
                return pd_cmd_usage_error(cmd, "--debug-kv-pause must be hello_ack, mid_slab or before_done");
            o->ep.debug_kv_pause = optarg;
            break;
        case O_MAXCONN: o->ap.max_connections = (int)v; break;
        case O_KATO: o->ap.keepalive_timeout_s = (int)v; break;
        case O_HDRTO: o->ap.header_timeout_s = (int)v; break;
        case O_TRACE: o->trace_dir = optarg; break;
        case O_SPEC_MODEL: o->ep.spec_model_dir = optarg; break;
        case O_SPEC_K:
            if (v < 1 || v > PD_SPEC_MAX_K) return pd_cmd_usage_error(cmd, "--num-speculative-tokens must be 1..%d", PD_SPEC_MAX_K);
            o->ep.spec_k = (int)v;
            break;
        case O_SPEC_METHOD: {
            pd_spec_method m;
            if (pd_spec_method_parse(optarg, &m) != PD_OK)
                return pd_cmd_usage_error(cmd, "--speculative-method must be none, draft, ngram or lookahead");
            o->ep.spec_method = (int)m;
            o->spec_method_set = true;
            break;
        }
        case O_SPEC_FIXED: o->ep.spec_fixed = true; break;
        case O_LA_W:
            if (v < 1 || v > PD_SPEC_MAX_W) return pd_cmd_usage_error(cmd, "--lookahead-window must be 1..%d", PD_SPEC_MAX_W);
            o->ep.spec_lookahead_w = (int)v;
            break;
        case O_LA_N:
            if (v < 2 || v > PD_SPEC_MAX_N) return pd_cmd_usage_error(cmd, "--lookahead-ngram must be 2..%d", PD_SPEC_MAX_N);
            o->ep.spec_lookahead_n = (int)v;
            break;
        case O_NGRAM_MAX:
            if (v < 1 || v > 64) return pd_cmd_usage_error(cmd, "--ngram-max must be 1..64");
            o->ep.spec_ngram_max = (int)v;
            break;
        case O_THREADS:
            if (v < 1 || v > 4096) return pd_cmd_usage_error(cmd, "--threads must be 1..4096");
            o->ep.n_threads = (int)v;
            break;
        case O_SDT:
            if (v > 86400) return pd_cmd_usage_error(cmd, "--shutdown-timeout must be 0..86400 seconds");
            o->shutdown_timeout_s = (int)v;
            break;
        case O_KVDT:
            if (!pd_kv_dtype_parse(optarg, &o->ep.kv_cache_dtype))
                return pd_cmd_usage_error(cmd, "--kv-cache-dtype is auto or fp8, not '%s'", optarg);
            break;
        case O_OFF_DRAM:
            if (!parse_bytes(optarg, &bytes) || !bytes) return pd_cmd_usage_error(cmd, "bad --kv-offload-dram '%s' (a size: 512M, 4G)", optarg);
            o->ep.kv_offload_dram_bytes = bytes;
            break;
        case O_OFF_DISK:
            if (!*optarg) return pd_cmd_usage_error(cmd, "--kv-offload-disk wants a directory");
            o->ep.kv_offload_disk_dir = optarg;
            break;
        case O_OFF_DISK_SIZE:
            if (!parse_bytes(optarg, &bytes) || !bytes)
                return pd_cmd_usage_error(cmd, "bad --kv-offload-disk-size '%s' (a size: 512M, 4G)", optarg);
            o->ep.kv_offload_disk_bytes = bytes;
            break;
        case O_OFF_REMOTE: {
            const char *hp = strncmp(optarg, "redis://", 8) ? NULL : optarg + 8;
            const char *colon = hp ? strrchr(hp, ':') : NULL;
            long port = 0;
            if (!colon || colon == hp || !pd_cmd_parse_int(colon + 1, &port) || port < 1 || port > 65535)
                return pd_cmd_usage_error(cmd, "--kv-remote wants redis://HOST:PORT, got '%s'", optarg);
            o->ep.kv_remote_url = optarg;
            break;
        }
        case O_OFF_DTYPE:
            if (strcmp(optarg, "bf16") && strcmp(optarg, "fp8") && strcmp(optarg, "int8") && strcmp(optarg, "f32"))
                return pd_cmd_usage_error(cmd, "--kv-offload-dtype must be bf16, fp8, int8 or f32, not '%s'", optarg);
            o->ep.kv_offload_dtype = optarg;
            break;
        case O_HELP: serve_usage(o->is_run); return 0;
        default: return 2;
        }
    }
    if (optind != argc) return pd_cmd_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    if (o->ep.role == PD_ROLE_DECODE && o->ep.n_prefill_addrs == 0)
        return pd_cmd_usage_error(cmd, "--role decode needs at least one --prefill HOST:PORT");
    if (o->ep.role != PD_ROLE_DECODE && o->ep.n_prefill_addrs)
        return pd_cmd_usage_error(cmd, "--prefill only applies to --role decode");
    if (!o->ep.kv_offload_disk_dir != !o->ep.kv_offload_disk_bytes)
        return pd_cmd_usage_error(cmd, "--kv-offload-disk DIR and --kv-offload-disk-size SIZE go together");
    if (o->ep.kv_offload_dtype && !o->ep.kv_offload_disk_dir && !o->ep.kv_remote_url)
        return pd_cmd_usage_error(cmd, "--kv-offload-dtype applies to the disk and remote tiers (--kv-offload-disk, --kv-remote)");
    if (o->ep.spec_model_dir && !o->spec_method_set) o->ep.spec_method = PD_SPEC_DRAFT;
    if (o->ep.spec_model_dir && o->ep.spec_method != PD_SPEC_DRAFT)
        return pd_cmd_usage_error(cmd, "--speculative-model only applies to --speculative-method draft");
    if (o->ep.spec_method == PD_SPEC_DRAFT && !o->ep.spec_model_dir)
        return pd_cmd_usage_error(cmd, "--speculative-method draft needs --speculative-model DIR");
    if (!o->ep.model_dir) {
        if (!o->is_run) return pd_cmd_usage_error(cmd, "--model DIR is required");
        o->ep.model_dir = pd_cmd_default_model(argv[0]);
    }
    return -1;
}

// ---- the loop ----------------------------------------------------------------------------------

typedef struct serve_ctx {
    serve_opts *o;
    struct event_base *base;
    pd_api *api;
    struct evhttp_connection *client;  // `run`: the sample request's connection
    pd_engine *engine;
    struct reg_ctx *reg;               // router registration, or NULL
    struct ctl_ctx *ctl;               // NATS presence (cluster mode), or NULL
} serve_ctx;

static void print_sample_answer(serve_ctx *s, struct evhttp_request *req) {
    int port = pd_api_port(s->api);
    const char *host = s->o->ap.host ? s->o->ap.host : "127.0.0.1";
    int code = req ? evhttp_request_get_response_code(req) : 0;
    struct evbuffer *b = req ? evhttp_request_get_input_buffer(req) : NULL;
    size_t n = b ? evbuffer_get_length(b) : 0;
    char *body = pd_malloc(n + 1);
    if (body) {
        if (n) evbuffer_copyout(b, body, n);
        body[n] = 0;
    }
    json_t *o = body && code == 200 ? json_loads(body, 0, NULL) : NULL;
    json_t *msg = json_object_get(json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message"), "content");
    if (json_is_string(msg)) {
        printf("\nsample request: chat completion, user says \"In the beginning\"\nanswer: %s\n", json_string_value(msg));
    } else {
        printf("\nsample request failed (HTTP %d): %s\n", code, body ? body : "");
    }
    printf("\npdserve is serving %s at http://%s:%d  (Ctrl-C to stop)\n", pd_api_model_name(s->api), host, port);
    printf("try:\n  curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' \\\n"
           "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"And God said\"}], \"max_tokens\": 32}'\n",
           host, port);
    fflush(stdout);
    json_decref(o);
    pd_free(body);
    if (s->o->exit_after_sample) event_base_loopbreak(s->base);
}

static void on_sample_done(struct evhttp_request *req, void *arg) { print_sample_answer(arg, req); }

static void send_sample(serve_ctx *s) {
    const char *host = s->o->ap.host && strcmp(s->o->ap.host, "0.0.0.0") ? s->o->ap.host : "127.0.0.1";
    s->client = evhttp_connection_base_new(s->base, NULL, host, (ev_uint16_t)pd_api_port(s->api));
    struct evhttp_request *req = s->client ? evhttp_request_new(on_sample_done, s) : NULL;
    if (!req) {
        print_sample_answer(s, NULL);
        return;
    }
    char body[256];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"In the beginning\"}],\"max_tokens\":%d,\"temperature\":0}",
             s->o->sample_max_tokens);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    evhttp_add_header(evhttp_request_get_output_headers(req), "Host", host);
    evbuffer_add(evhttp_request_get_output_buffer(req), body, strlen(body));
    if (evhttp_make_request(s->client, req, EVHTTP_REQ_POST, "/v1/chat/completions")) print_sample_answer(s, NULL);
}

// ---- router registration -----------------------------------------------------------------------
// POST <router>/internal/register with our URL, role, model and block size, at start and every
// 10 s (re-registering is idempotent and re-announces us to a restarted router); at exit one
// POST /internal/deregister, waited for at most 2 s.

typedef struct reg_ctx {
    serve_ctx *s;
    pd_http_client *client;
    struct event *timer;
    char *auth;                 // "Bearer <token>" or NULL (owned)
    char url[PD_WIRE_URL_MAX];  // our advertised URL
    pd_http_client_call *call;  // in flight, or NULL
    bool is_registered, is_final, has_failed;
    bool has_left;              // draining: deregistered, no more re-registration
} reg_ctx;

static void on_reg_done(pd_http_client_call *call, pd_status st, int http, const char *msg, void *ud) {
    reg_ctx *g = ud;
    PD_UNUSED(call);
    g->call = NULL;
    bool ok = st == PD_OK && http == 200;
    if (g->is_final) {
        event_base_loopbreak(g->s->base);
        return;
    }
    if (g->has_left) return;
    if (ok && !g->is_registered) fprintf(stderr, "pdserve: registered with router %s as %s\n", g->s->o->router_url, g->url);
    if (!ok && (g->is_registered || !g->has_failed))
        fprintf(stderr, "pdserve: router %s: registration failed (%s, HTTP %d); retrying every 10 s\n", g->s->o->router_url,
                st == PD_OK ? "refused" : msg, http);
    g->has_failed |= !ok;
    g->is_registered = ok;
}

static void reg_send(reg_ctx *g, bool deregister) {
    char target[PD_WIRE_URL_MAX + 32];
    snprintf(target, sizeof target, "%s/internal/%s", g->s->o->router_url, deregister ? "deregister" : "register");
    json_t *o;
    if (deregister) {
        o = pd_wire_deregister_to_json(g->url);
    } else {
        pd_wire_register m = {0};
        snprintf(m.url, sizeof m.url, "%s", g->url);
        m.role = g->s->o->ep.role == PD_ROLE_PREFILL ? PD_WIRE_ROLE_PREFILL
                 : g->s->o->ep.role == PD_ROLE_DECODE ? PD_WIRE_ROLE_DECODE : PD_WIRE_ROLE_BOTH;
        snprintf(m.model, sizeof m.model, "%s", pd_api_model_name(g->s->api));
        m.block_size = g->s->o->ep.block_size;
        o = pd_wire_register_to_json(&m);
    }
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!body) return;
    const char *hdrs[] = {"Authorization", g->auth, NULL};
    pd_http_client_request rq = {.method = "POST", .url = target, .headers = g->auth ? hdrs : NULL,
                                 .body = body, .body_len = strlen(body)};
    pd_http_client_callbacks cb = {.on_done = on_reg_done};
    pd_err err = {0};
    g->call = pd_http_client_send(g->client, &rq, &cb, g, &err);
    if (!g->call) fprintf(stderr, "pdserve: router %s: %s\n", g->s->o->router_url, err.msg);
    free(body);
}

static void on_reg_timer(evutil_socket_t fd, short what, void *arg) {
    reg_ctx *g = arg;
    PD_UNUSED(fd);
    PD_UNUSED(what);
    if (!g->call) reg_send(g, false);
}

// Starts registration; false (with a message) on a setup error.
static bool reg_start(reg_ctx *g, serve_ctx *s) {
    memset(g, 0, sizeof *g);
    g->s = s;
    serve_opts *o = s->o;
    if (o->advertise_url) {
        snprintf(g->url, sizeof g->url, "%s", o->advertise_url);
    } else {
        const char *h = o->ap.host && strcmp(o->ap.host, "0.0.0.0") ? o->ap.host : "127.0.0.1";
        snprintf(g->url, sizeof g->url, "http://%s:%d", h, pd_api_port(s->api));
    }
    const char *token_file = o->router_token_file ? o->router_token_file : o->auth_token_file;
    if (token_file) {
        char *tok = NULL;
        size_t n = 0;
        pd_err err = {0};
        if (pd_file_read_all(token_file, &tok, &n, &err)) {
            fprintf(stderr, "pdserve: %s\n", err.msg);
            return false;
        }
        while (n && (tok[n - 1] == '\n' || tok[n - 1] == '\r' || tok[n - 1] == ' ')) tok[--n] = 0;
        g->auth = pd_malloc(n + 8);
        if (g->auth) snprintf(g->auth, n + 8, "Bearer %s", tok);
        pd_free(tok);
        if (!g->auth) return false;
    }
    pd_http_client_params cp = pd_http_client_params_default();
    cp.max_connections = 2;
    cp.request_timeout_ms = 5000;
    g->client = pd_http_client_new(s->base, &cp, NULL);
    g->timer = event_new(s->base, -1, EV_PERSIST, on_reg_timer, g);
    struct timeval tv = {10, 0};
    if (!g->client || !g->timer || event_add(g->timer, &tv)) return false;
    reg_send(g, false);
    return true;
}

static void on_reg_deadline(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    event_base_loopbreak(arg);
}

// Draining: withdraws the registration now (the router stops routing here); no re-registration.
static void reg_leave(reg_ctx *g) {
    if (!g->client || g->has_left) return;
    if (g->timer) event_del(g->timer);
    if (g->call) pd_http_client_call_cancel(g->call);
    g->call = NULL;
    g->has_left = true;
    reg_send(g, true);
}

// Deregisters (waiting at most 2 s on the loop) and frees everything.
static void reg_stop(reg_ctx *g) {
    if (g->timer) event_free(g->timer);
    if (g->client && g->s->api) {
        if (g->call) pd_http_client_call_cancel(g->call);
        g->call = NULL;
        g->is_final = true;
        reg_send(g, true);
        if (g->call) {
            struct event *deadline = evtimer_new(g->s->base, on_reg_deadline, g->s->base);
            struct timeval tv = {2, 0};
            if (deadline && !evtimer_add(deadline, &tv)) event_base_dispatch(g->s->base);
            if (deadline) event_free(deadline);
        }
    }
    pd_http_client_free(g->client);
    pd_free(g->auth);
    memset(g, 0, sizeof *g);
}

// ---- cluster mode: presence over NATS (control/control.h) -------------------------------------------
// Every heartbeat: PUBLISH pdserve.presence.<role>.<instance> = our STATE (load, the KV events since
// the previous presence, the link model) + "url", "since", "heartbeat_ms". Requests on
// pdserve.resync.<instance> ("since=N") are answered with the STATE since N (a router that missed a
// presence). Draining: one presence with "leaving": true.
#define RESYNC_PER_S 20

typedef struct ctl_ctx {
    serve_ctx *s;
    pd_ctl *ctl;
    struct event *timer, *ev_inbox;
    char url[PD_WIRE_URL_MAX];
    char subj[96], resync_subj[96];
    uint64_t seq_next;          // the next event to publish
    int64_t pseq;               // presences published (each carries the next: the router drops replays)
    bool has_left;
    // refusals (logged at most once a second a kind): claims from an address we do not dial or
    // malformed, resync requests malformed or over the rate limit
    int64_t n_claims_refused, n_resyncs_refused, t_claim_log_us, t_resync_log_us;
    int64_t t_resync_window_us;
    int n_resync_window;
    int64_t n_bad_logged, t_bad_log_us;  // unsigned / over-cap drops last logged
    // the prefill work queue (--prefill-queue)
    pd_ctl_jobq *jobq;
    char instance[24];          // ours (decode: the jobs name it; claims come on pdserve.claim.<instance>)
    char claim_subj[96];
    char kv_addr[300];          // prefill: our KV address as decode workers dial it
    pthread_t fetch_thread;
    bool has_fetch_thread;
    int stop;                   // atomic
} ctl_ctx;

static void advertised_url(serve_ctx *s, char *out, size_t n) {
    serve_opts *o = s->o;
    if (o->advertise_url) {
        snprintf(out, n, "%s", o->advertise_url);
    } else {
        const char *h = o->ap.host && strcmp(o->ap.host, "0.0.0.0") ? o->ap.host : "127.0.0.1";
        snprintf(out, n, "http://%s:%d", h, pd_api_port(s->api));
    }
}

static void on_claim(ctl_ctx *g, const pd_ctl_msg *m);

static void ctl_publish(ctl_ctx *g, bool leaving) {
    uint64_t since = g->seq_next;
    json_t *o = pd_api_state_json(g->s->api, since, 4096);
    if (!o) return;
    json_object_set_new(o, "url", json_string(g->url));
    json_object_set_new(o, "since", json_integer((json_int_t)since));
    json_object_set_new(o, "heartbeat_ms", json_integer(g->s->o->control_heartbeat_ms));
    json_object_set_new(o, "pseq", json_integer((json_int_t)++g->pseq));
    if (leaving) json_object_set_new(o, "leaving", json_true());
    json_t *sn = json_object_get(json_object_get(o, "events"), "seq_next");
    bool has_next = json_is_integer(sn);
    uint64_t next = has_next ? (uint64_t)json_integer_value(sn) : 0;  // (read before o is freed)
    char *txt = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (txt && pd_ctl_publish(g->ctl, g->subj, NULL, txt, (int)strlen(txt)) == PD_OK && has_next) g->seq_next = next;
    free(txt);
}

static void on_ctl_timer(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    ctl_ctx *g = arg;
    if (!g->has_left) ctl_publish(g, false);
    pd_ctl_stats st;
    pd_ctl_stats_get(g->ctl, &st);
    int64_t now = pd_time_us();
    if (st.bad_mac + st.inbox_full > g->n_bad_logged && now - g->t_bad_log_us > 1000000) {  // at most once a second
        PD_LOG_W("control: %lld NATS messages without a valid signature and %lld over the inbox cap dropped so far",
                 (long long)st.bad_mac, (long long)st.inbox_full);
        g->n_bad_logged = st.bad_mac + st.inbox_full;
        g->t_bad_log_us = now;
    }
}

static void on_ctl_inbox(evutil_socket_t fd, short what, void *arg) {
    PD_UNUSED(fd);
    PD_UNUSED(what);
    ctl_ctx *g = arg;
    pd_ctl_msg *list = pd_ctl_inbox_take(g->ctl);
    for (pd_ctl_msg *m = list; m; m = m->next) {
        if (m->reply && !strcmp(m->subject, g->claim_subj)) {
            on_claim(g, m);
            continue;
        }
        if (strcmp(m->subject, g->resync_subj) || !m->reply) continue;  // ($pd.conn: libnats reconnects)
        // "since=N" (N a decimal count); answered at most RESYNC_PER_S times a second: each answer
        // is up to 64k events, and a router asks at most once a second per worker
        char *end = NULL;
        unsigned long long since = 0;
        bool ok = !strncmp(m->data, "since=", 6) && m->data[6] >= '0' && m->data[6] <= '9' && m->len < 32;
        errno = 0;
        if (ok) since = strtoull(m->data + 6, &end, 10);
        ok = ok && end && !*end && errno != ERANGE;
        int64_t now = pd_time_us();
        if (now - g->t_resync_window_us > 1000000) {
            g->t_resync_window_us = now;
            g->n_resync_window = 0;
        }
        if (!ok || ++g->n_resync_window > RESYNC_PER_S) {
            g->n_resyncs_refused++;
            if (now - g->t_resync_log_us > 1000000) {
                g->t_resync_log_us = now;
                PD_LOG_W("control: resync request refused (%s; %lld refused so far)", ok ? "over the rate limit" : "malformed",
                         (long long)g->n_resyncs_refused);
            }
            continue;
        }
        json_t *o = pd_api_state_json(g->s->api, since, 1 << 16);
        char *txt = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        if (txt) pd_ctl_publish(g->ctl, m->reply, NULL, txt, (int)strlen(txt));
        free(txt);
    }
    pd_ctl_msg_free(list);
}

// ---- the prefill work queue (JetStream; --prefill-queue) ------------------------------------------
// decode: the engine queued a remote prefill: publish the job {"decode": <instance>, "req": id}
// (asynchronously: the engine thread does not wait for JetStream's ack).
static void on_prefill_enqueue(void *ud, uint64_t req_id, int n_tokens) {
    ctl_ctx *g = ud;
    char job[128];
    int n = snprintf(job, sizeof job, "{\"decode\":\"%s\",\"req\":%llu,\"tokens\":%d}", g->instance,
                     (unsigned long long)req_id, n_tokens);
    if (!g->jobq || pd_ctl_jobq_push_async(g->jobq, job, n) != PD_OK)
        PD_LOG_W("control: cannot queue prefill job %llu (it falls back when its deadline passes)", (unsigned long long)req_id);
}

// decode: a prefill worker claims a job: "req=<id> kv=<host:port>" → "ok" | "gone" | "busy" |
// "refused". Only an address this worker dials itself (--prefill) is ever sent the request:
// anything else is refused and logged (the job stays queued for a real prefill worker).
static void on_claim(ctl_ctx *g, const pd_ctl_msg *m) {
    // (parsed by hand: sscanf's %llu is undefined on overflow)
    unsigned long long id = 0;
    const char *ans = "bad", *kv = NULL;
    char *end = NULL;
    pd_status st = PD_ERR_PROTO;
    errno = 0;
    if (m->len < 340 && !strncmp(m->data, "req=", 4) && m->data[4] >= '0' && m->data[4] <= '9') {
        id = strtoull(m->data + 4, &end, 10);
        if (errno != ERANGE && !strncmp(end, " kv=", 4)) kv = end + 4;
    }
    bool kv_ok = kv && *kv;
    for (const char *p = kv; kv_ok && *p; p++) kv_ok = *p > ' ' && *p < 127;  // host:port, no spaces or controls
    if (kv_ok && strlen(kv) < 300) {
        st = pd_engine_prefill_claim(g->s->engine, id, kv);
        ans = st == PD_OK ? "ok" : st == PD_ERR_NOTFOUND ? "gone" : st == PD_ERR_INVALID ? "refused" : "busy";
    }
    if (st == PD_ERR_PROTO || st == PD_ERR_INVALID) {
        g->n_claims_refused++;
        int64_t now = pd_time_us();
        if (now - g->t_claim_log_us > 1000000) {
            g->t_claim_log_us = now;
            PD_LOG_W("control: prefill claim refused: %s (%lld refused so far)",
                     st == PD_ERR_PROTO ? "malformed" : "an address this worker does not dial", (long long)g->n_claims_refused);
        }
    }
    pd_ctl_publish(g->ctl, m->reply, NULL, ans, (int)strlen(ans));
}

// prefill: pull one job at a time while our own queue is empty, claim it from its decode worker
// (which then sends the PREFILL_REQ over our authenticated KV connection), ack it. A job we fetch
// and die holding is redelivered by JetStream after its ack wait to another prefill worker.
static void *fetch_main(void *arg) {
    ctl_ctx *g = arg;
    while (!__atomic_load_n(&g->stop, __ATOMIC_ACQUIRE)) {
        pd_engine_stats st;
        memset(&st, 0, sizeof st);
        pd_engine_stats_get(g->s->engine, &st);
        if (st.n_waiting > 0) {  // busy: leave the jobs to idle workers
            poll(NULL, 0, 20);
            continue;
        }
        pd_ctl_job *job = NULL;
        if (pd_ctl_jobq_fetch(g->jobq, &job, 1, 500) != 1) continue;
        int len = 0;
        const char *d = pd_ctl_job_data(job, &len);
        json_t *o = json_loadb(d, (size_t)len, 0, NULL);
        const char *dec = o ? json_string_value(json_object_get(o, "decode")) : NULL;
        json_t *rq = o ? json_object_get(o, "req") : NULL;
        int64_t nd = pd_ctl_job_n_delivered(job);
        size_t dl = dec ? strlen(dec) : 0;
        bool dec_ok = dl == 16;  // an instance id: 16 hex digits (it becomes part of a subject)
        for (size_t i = 0; dec_ok && i < dl; i++) dec_ok = (dec[i] >= '0' && dec[i] <= '9') || (dec[i] >= 'a' && dec[i] <= 'f');
        if (!dec_ok || !json_is_integer(rq) || json_integer_value(rq) < 0) {
            PD_LOG_W("control: malformed prefill job dropped");
            pd_ctl_job_ack(job);
            json_decref(o);
            continue;
        }
        unsigned long long id = (unsigned long long)json_integer_value(rq);
        if (nd > 1) fprintf(stderr, "pdserve: prefill job %s/%llu redelivered (delivery %lld)\n", dec, id, (long long)nd);
        if (g->s->o->debug_job_hold_ms > 0)
            fprintf(stderr, "pdserve: prefill job %s/%llu fetched; holding it %d ms (test hook)\n", dec, id, g->s->o->debug_job_hold_ms);
        for (int t = 0; t < g->s->o->debug_job_hold_ms / 10 && !__atomic_load_n(&g->stop, __ATOMIC_ACQUIRE); t++)
            poll(NULL, 0, 10);  // test hook: a worker that dies holding a job
        char subj[96], body[400];
        snprintf(subj, sizeof subj, "pdserve.claim.%s", dec);
        int n = snprintf(body, sizeof body, "req=%llu kv=%s", id, g->kv_addr);
        char *reply = NULL;
        pd_status rs = pd_ctl_request(g->ctl, subj, body, n, 2000, &reply);
        if (rs == PD_OK && !strcmp(reply, "ok")) {
            fprintf(stderr, "pdserve: prefill job %s/%llu claimed\n", dec, id);
            pd_ctl_job_ack(job);
        } else if ((rs == PD_OK && !strcmp(reply, "gone")) || rs == PD_ERR_NOTFOUND || nd >= 5) {
            // served already (a claim whose answer came too late), timed out, or its decode worker
            // is gone: nothing to do
            fprintf(stderr, "pdserve: prefill job %s/%llu not queued any more: acked\n", dec, id);
            pd_ctl_job_ack(job);
        } else {
            fprintf(stderr, "pdserve: prefill job %s/%llu: %s: nak (redelivered)\n", dec, id,
                    rs == PD_OK ? reply : pd_status_str(rs));
            pd_ctl_job_nak(job);  // busy (no connection to us yet) or no answer: redeliver
        }
        pd_free(reply);
        json_decref(o);
    }
    return NULL;
}

// Connects before the engine exists (a decode engine's first queued job needs the queue).
static bool ctl_connect(ctl_ctx *g, serve_opts *o, const char *token) {
    memset(g, 0, sizeof *g);
    if (!token) {
        fprintf(stderr, "pdserve: --control needs --auth-token-file (the NATS connection authenticates)\n");
        return false;
    }
    char name[64];
    snprintf(name, sizeof name, "pdserve-%s", pd_engine_role_name(o->ep.role));
    pd_ctl_params cp = {.url = o->control_url, .token = token, .nkey_seed_file = o->control_nkey_seed, .sign_key = token,
                        .name = name};
    pd_err err = {0};
    if (!(g->ctl = pd_ctl_connect(&cp, &err))) {
        fprintf(stderr, "pdserve: control plane: %s\n", err.msg);
        return false;
    }
    if (o->prefill_queue) {
        g->jobq = pd_ctl_jobq_new(g->ctl, o->ep.role == PD_ROLE_PREFILL, 2000, 10, &err);
        if (!g->jobq) {
            fprintf(stderr, "pdserve: control plane: %s\n", err.msg);
            return false;
        }
        if (o->ep.role == PD_ROLE_DECODE) {
            o->ep.on_prefill_enqueue = on_prefill_enqueue;
            o->ep.prefill_enqueue_ud = g;
        }
    }
    return true;
}

// false (with a message) when NATS cannot be reached or refuses us: the worker does not start.
static bool ctl_start(ctl_ctx *g, serve_ctx *s) {
    g->s = s;
    serve_opts *o = s->o;
    if (o->control_heartbeat_ms <= 0) o->control_heartbeat_ms = 200;
    advertised_url(s, g->url, sizeof g->url);
    json_t *st = pd_api_state_json(s->api, 0, 0);
    const char *inst = st ? json_string_value(json_object_get(st, "instance")) : NULL;
    const char *role = st ? json_string_value(json_object_get(st, "role")) : NULL;
    snprintf(g->instance, sizeof g->instance, "%s", inst ? inst : "0");
    snprintf(g->subj, sizeof g->subj, "%s.%s.%s", PD_CTL_SUBJ_PRESENCE, role ? role : "both", g->instance);
    snprintf(g->resync_subj, sizeof g->resync_subj, "%s.%s", PD_CTL_SUBJ_RESYNC, g->instance);
    snprintf(g->claim_subj, sizeof g->claim_subj, "pdserve.claim.%s", g->instance);
    json_decref(st);
    pd_err err = {0};
    if (pd_ctl_subscribe(g->ctl, g->resync_subj, &err) ||
        (g->jobq && o->ep.role == PD_ROLE_DECODE && pd_ctl_subscribe(g->ctl, g->claim_subj, &err))) {
        fprintf(stderr, "pdserve: control plane: %s\n", err.msg);
        return false;
    }
    g->timer = event_new(s->base, -1, EV_PERSIST, on_ctl_timer, g);
    g->ev_inbox = event_new(s->base, pd_ctl_inbox_fd(g->ctl), EV_READ | EV_PERSIST, on_ctl_inbox, g);
    struct timeval tv = {o->control_heartbeat_ms / 1000, (o->control_heartbeat_ms % 1000) * 1000};
    if (!g->timer || !g->ev_inbox || event_add(g->timer, &tv) || event_add(g->ev_inbox, NULL)) return false;
    if (g->jobq && o->ep.role == PD_ROLE_PREFILL) {
        snprintf(g->kv_addr, sizeof g->kv_addr, "%s:%d", o->ep.kv_host ? o->ep.kv_host : "127.0.0.1", pd_engine_kv_port(s->engine));
        if (pthread_create(&g->fetch_thread, NULL, fetch_main, g)) return false;
        g->has_fetch_thread = true;
        fprintf(stderr, "pdserve: control plane: pulling prefill jobs from JetStream as %s\n", g->kv_addr);
    }
    ctl_publish(g, false);
    fprintf(stderr, "pdserve: control plane: presence on %s every %d ms\n", g->subj, o->control_heartbeat_ms);
    return true;
}

static void ctl_leave(ctl_ctx *g) {
    if (!g->ctl || g->has_left) return;
    ctl_publish(g, true);
    g->has_left = true;
}

static void ctl_stop(ctl_ctx *g) {
    __atomic_store_n(&g->stop, 1, __ATOMIC_RELEASE);
    if (g->has_fetch_thread) pthread_join(g->fetch_thread, NULL);  // (a fetch waits 500 ms at most)
    pd_ctl_jobq_free(g->jobq);
    if (g->timer) event_free(g->timer);
    if (g->ev_inbox) event_free(g->ev_inbox);
    pd_ctl_free(g->ctl);
    memset(g, 0, sizeof *g);
}

// ---- graceful shutdown (shutdown.c drives these) -------------------------------------------------

static void sd_drain(void *ud) {
    serve_ctx *s = ud;
    pd_api_drain(s->api, 1);
    if (s->reg) reg_leave(s->reg);
    if (s->ctl) ctl_leave(s->ctl);
}

static bool sd_is_drained(void *ud) {
    serve_ctx *s = ud;
    if (!pd_api_is_drained(s->api)) return false;
    if (s->o->ep.role != PD_ROLE_PREFILL) return true;
    // A prefill worker's work comes from decode workers over the KV port, not over HTTP.
    pd_engine_stats st;
    memset(&st, 0, sizeof st);
    pd_engine_stats_get(s->engine, &st);
    return st.n_running + st.n_waiting == 0;
}

static void sd_end_all(void *ud, const char *msg) { pd_api_end_all(((serve_ctx *)ud)->api, msg); }

static int serve_main(serve_opts *o) {
    signal(SIGPIPE, SIG_IGN);  // a client that vanished mid-write must not kill the server
    pd_err err = {0};
    if (pd_trace_init(pd_engine_role_name(o->ep.role), o->trace_dir, &err) != PD_OK) {
        fprintf(stderr, "pdserve: %s\n", err.msg);
        return 1;
    }
    char *secret = NULL;
    if (o->auth_token_file && pd_auth_load_file(o->auth_token_file, &secret, &err)) {
        fprintf(stderr, "pdserve: %s\n", err.msg);
        return 1;
    }
    o->ep.kv_secret = secret;
    ctl_ctx ctl = {0};
    if (o->control_url && !ctl_connect(&ctl, o, secret)) {
        ctl_stop(&ctl);
        pd_free(secret);
        return 1;
    }
    fprintf(stderr, "pdserve: loading %s\n", o->ep.model_dir);
    pd_engine *e = pd_engine_new(&o->ep, &err);
    o->ep.kv_secret = NULL;  // the connector keeps its own copy; ours is the NATS token (--control)
    if (!e) {
        fprintf(stderr, "pdserve: %s\n", err.msg);
        ctl_stop(&ctl);
        pd_free(secret);
        return 1;
    }
    if (pd_engine_start(e)) {
        fprintf(stderr, "pdserve: cannot start the engine thread\n");
        pd_engine_free(e);
        ctl_stop(&ctl);
        pd_free(secret);
        return 1;
    }
    int rc = 1;
    serve_ctx s = {.o = o, .engine = e};
    reg_ctx reg = {0};
    pd_cmd_shutdown sd = {0};
    s.base = event_base_new();
    if (!s.base) goto done;
    s.api = pd_api_new(s.base, e, &o->ap, &err);
    if (!s.api) {
        fprintf(stderr, "pdserve: %s\n", err.msg);
        goto done;
    }
    sd.base = s.base;
    sd.who = "pdserve";
    sd.timeout_s = o->shutdown_timeout_s;
    sd.ud = &s;
    sd.drain = sd_drain;
    sd.is_drained = sd_is_drained;
    sd.end_all = sd_end_all;
    if (pd_cmd_shutdown_install(&sd)) goto done;
    if (o->ep.role == PD_ROLE_PREFILL)  // printed before the URL: scripts read it once the URL shows
        printf("pdserve: prefill worker, KV port %s:%d\n", o->ep.kv_host ? o->ep.kv_host : "127.0.0.1",
               pd_engine_kv_port(e));
    printf("pdserve: serving %s (%s, max_model_len %d) on http://%s:%d\n", pd_api_model_name(s.api),
           pd_engine_role_name(o->ep.role), pd_engine_max_model_len(e), o->ap.host ? o->ap.host : "127.0.0.1",
           pd_api_port(s.api));
    fflush(stdout);
    if (o->is_run) send_sample(&s);
    if (o->router_url) {
        if (!reg_start(&reg, &s)) goto done;
        s.reg = &reg;
    }
    if (o->control_url) {
        if (!ctl_start(&ctl, &s)) goto done;
        s.ctl = &ctl;
    }
    event_base_dispatch(s.base);
    rc = 0;
done:
    if (o->router_url) reg_stop(&reg);
    ctl_stop(&ctl);
    pd_free(secret);
    if (s.client) evhttp_connection_free(s.client);
    pd_cmd_shutdown_fini(&sd);
    pd_api_free(s.api);
    pd_engine_free(e);
    if (s.base) event_base_free(s.base);
    pd_trace_shutdown();
    if (rc == 0) fprintf(stderr, "pdserve: stopped\n");
    return rc;
}

static int serve_or_run(int argc, char **argv, bool is_run) {
    serve_opts o = {0};
    o.ep = pd_engine_params_default();
    o.ap = pd_api_params_default();
    o.ap.port = 8000;
    o.is_run = is_run;
    o.sample_max_tokens = 48;
    o.shutdown_timeout_s = PD_CMD_SHUTDOWN_TIMEOUT_S;
    int rc = parse_flags(argc, argv, &o);
    if (rc >= 0) return rc;
    if (!o.link_aware_set) o.ep.disagg_link_aware = o.control_url != NULL;  // cluster mode decides by the links
    if (o.prefill_queue && (!o.control_url || o.ep.role == PD_ROLE_BOTH))
        return pd_cmd_usage_error("serve", "--prefill-queue needs --control and --role prefill or decode");
    return serve_main(&o);
}

int pd_cmd_serve(int argc, char **argv) { return serve_or_run(argc, argv, false); }
// `pdserve run --colocated` (run.c dispatches): the single-process embedded default.
int pd_cmd_run_colocated(int argc, char **argv) { return serve_or_run(argc, argv, true); }
