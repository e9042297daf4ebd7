// router.c — `pdserve router`: flags → pd_router_params → pd_router_new → one libevent loop until
// SIGINT/SIGTERM. All the logic is in src/router/.
#include <event2/event.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "metrics/trace.h"
#include "cmd/cmd.h"
#include "router/router.h"

#define MAX_URLS PD_ROUTER_MAX_WORKERS

typedef struct router_opts {
    pd_router_params p;
    const char *workers[MAX_URLS], *prefill[MAX_URLS], *decode[MAX_URLS];
    const char *token_file, *qos_file, *trace_dir;
    int shutdown_timeout_s;
} router_opts;

static void usage(void) {
    printf("usage: pdserve router [options]\n\n"
           "  --host H                 address to bind (default 127.0.0.1)\n"
           "  --port P                 port (default 8080; 0 = any free port, printed at start)\n"
           "  --worker URL             a worker (role both); repeatable\n"
           "  --prefill URL            a prefill worker; repeatable\n"
           "  --decode URL             a decode worker; repeatable\n"
           "  --auth-token-file F      bearer token required by POST /internal/register and /deregister\n"
           "                           (without it both are refused)\n"
           "  --routing kv|load|round-robin|random   (default kv)\n"
           "  --slo-ttft-ms N          default TTFT SLO for admission (0 = none)\n"
           "  --slo-tpot-ms N          default TPOT SLO for admission (0 = none)\n"
           "  --qos-config FILE        QoS classes and API keys (JSON, see docs/router.md)\n"
           "  --heartbeat-ms N         worker poll period (default 200)\n"
           "  --control nats://H:P     cluster mode: workers come from their NATS presence (subscribed, not\n"
           "                           polled); the NATS connection presents the --auth-token-file token\n"
           "  --control-nkey-seed F    cluster mode: authenticate to NATS with this nkey user seed (pdserve\n"
           "                           nkey-gen) instead of the token; messages stay signed with the token\n"
           "  --control-expire-ms N    cluster mode: a worker without presence for N ms leaves rotation\n"
           "                           (default 4 heartbeats; never while NATS itself is down)\n"
           "  --max-connections N      open client connections at most (default: fd limit less 1/8);\n"
           "                           at the limit the longest-idle ones are closed\n"
           "  --keepalive-timeout S    close idle keep-alive connections after S s (default 30)\n"
           "  --header-timeout S       a request must arrive whole within S s of its first bytes (60)\n"
           "  --max-body-bytes N       request body limit in bytes (default 8388608)\n"
           "  --trace-dir DIR          write request spans as Chrome trace JSON (Perfetto) into DIR\n"
           "  --shutdown-timeout S     on SIGTERM/SIGINT: stop taking requests (503, /health \"draining\") and\n"
           "                           give running ones up to S seconds to finish (default 30)\n");
}

static int add_url(const char **arr, int *n, const char *url) {
    if (*n >= MAX_URLS) return pd_cmd_usage_error("router", "at most %d workers", MAX_URLS);
    arr[(*n)++] = url;
    return -1;
}

// Returns -1 on success, else the exit code.
static int parse_flags(int argc, char **argv, router_opts *o) {
    enum { O_HOST = 1, O_PORT, O_W, O_P, O_D, O_TOK, O_ROUT, O_TTFT, O_TPOT, O_QOS, O_HB, O_SDT, O_MAXCONN, O_KATO,
           O_HDRTO, O_BODY, O_TRACE, O_CTL, O_CTLEXP, O_CTLNKEY, O_HELP };
    static const struct option opts[] = {
        {"host", required_argument, 0, O_HOST}, {"port", required_argument, 0, O_PORT},
        {"worker", required_argument, 0, O_W}, {"prefill", required_argument, 0, O_P},
        {"decode", required_argument, 0, O_D}, {"auth-token-file", required_argument, 0, O_TOK},
        {"routing", required_argument, 0, O_ROUT}, {"slo-ttft-ms", required_argument, 0, O_TTFT},
        {"slo-tpot-ms", required_argument, 0, O_TPOT}, {"qos-config", required_argument, 0, O_QOS},
        {"heartbeat-ms", required_argument, 0, O_HB}, {"max-connections", required_argument, 0, O_MAXCONN},
        {"keepalive-timeout", required_argument, 0, O_KATO}, {"header-timeout", required_argument, 0, O_HDRTO},
        {"max-body-bytes", required_argument, 0, O_BODY}, {"trace-dir", required_argument, 0, O_TRACE},
        {"shutdown-timeout", required_argument, 0, O_SDT}, {"control", required_argument, 0, O_CTL},
        {"control-expire-ms", required_argument, 0, O_CTLEXP}, {"control-nkey-seed", required_argument, 0, O_CTLNKEY},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0}};
    long v;
    double d;
    int c, rc;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_HOST: o->p.host = optarg; break;
        case O_PORT:
            if (!pd_cmd_parse_int(optarg, &v) || v < 0 || v > 65535) return pd_cmd_usage_error("router", "bad --port");
            o->p.port = (int)v;
            break;
        case O_W: if ((rc = add_url(o->workers, &o->p.n_workers, optarg)) >= 0) return rc; break;
        case O_P: if ((rc = add_url(o->prefill, &o->p.n_prefill, optarg)) >= 0) return rc; break;
        case O_D: if ((rc = add_url(o->decode, &o->p.n_decode, optarg)) >= 0) return rc; break;
        case O_TOK: o->token_file = optarg; break;
        case O_ROUT:
            if (pd_router_routing_parse(optarg, &o->p.routing) != PD_OK)
                return pd_cmd_usage_error("router", "--routing must be kv, load, round-robin or random");
            break;
        case O_TTFT:
        case O_TPOT:
            if (!pd_cmd_parse_float(optarg, &d) || d < 0) return pd_cmd_usage_error("router", "bad SLO '%s'", optarg);
            if (c == O_TTFT) o->p.slo_ttft_ms = d;
            else o->p.slo_tpot_ms = d;
            break;
        case O_QOS: o->qos_file = optarg; break;
        case O_HB:
            if (!pd_cmd_parse_int(optarg, &v) || v < 10 || v > 60000)
                return pd_cmd_usage_error("router", "--heartbeat-ms must be 10..60000");
            o->p.heartbeat_ms = (int)v;
            break;
        case O_MAXCONN:
        case O_KATO:
        case O_HDRTO:
        case O_BODY:
            if (!pd_cmd_parse_int(optarg, &v) || v < 1 || v > (1l << 40))
                return pd_cmd_usage_error("router", "bad value '%s' for --%s", optarg,
                                          c == O_MAXCONN ? "max-connections" : c == O_KATO ? "keepalive-timeout"
                                                                             : c == O_HDRTO ? "header-timeout" : "max-body-bytes");
            if (c == O_MAXCONN) o->p.max_connections = (int)PD_MIN(v, 1l << 24);
            else if (c == O_KATO) o->p.keepalive_timeout_s = (int)PD_MIN(v, 1l << 24);
            else if (c == O_HDRTO) o->p.header_timeout_s = (int)PD_MIN(v, 1l << 24);
            else o->p.max_body_bytes = (size_t)v;
            break;
        case O_TRACE: o->trace_dir = optarg; break;
        case O_CTL:
            if (strncmp(optarg, "nats://", 7)) return pd_cmd_usage_error("router", "--control must be nats://HOST:PORT");
            o->p.control_url = optarg;
            break;
        case O_CTLNKEY: o->p.control_nkey_seed = optarg; break;
        case O_CTLEXP:
            if (!pd_cmd_parse_int(optarg, &v) || v < 10 || v > 600000)
                return pd_cmd_usage_error("router", "--control-expire-ms must be 10..600000");
            o->p.control_expire_ms = (int)v;
            break;
        case O_SDT:
            if (!pd_cmd_parse_int(optarg, &v) || v < 0 || v > 86400)
                return pd_cmd_usage_error("router", "--shutdown-timeout must be 0..86400 seconds");
            o->shutdown_timeout_s = (int)v;
            break;
        case O_HELP: usage(); return 0;
        default: return 2;
        }
    }
    if (optind != argc) return pd_cmd_usage_error("router", "unexpected argument '%s'", argv[optind]);
    return -1;
}

static void sd_drain(void *ud) { pd_router_drain(ud, 1); }
static bool sd_is_drained(void *ud) { return pd_router_is_drained(ud); }
static void sd_end_all(void *ud, const char *msg) { pd_router_end_all(ud, msg); }

// Reads the token file, trimming trailing whitespace. NULL (and a message) on failure.
static char *read_token(const char *path) {
    char *txt = NULL;
    size_t len = 0;
    pd_err err = {0};
    if (pd_file_read_all(path, &txt, &len, &err) != PD_OK) {
        fprintf(stderr, "pdserve router: %s\n", err.msg);
        return NULL;
    }
    while (len > 0 && (txt[len - 1] == '\n' || txt[len - 1] == '\r' || txt[len - 1] == ' ')) txt[--len] = 0;
    if (!len) {
        fprintf(stderr, "pdserve router: token file %s is empty\n", path);
        pd_free(txt);
        return NULL;
    }
    return txt;
}

int pd_cmd_router(int argc, char **argv) {
    router_opts o;
    memset(&o, 0, sizeof o);
    o.p = pd_router_params_default();
    o.p.port = 8080;
    o.shutdown_timeout_s = PD_CMD_SHUTDOWN_TIMEOUT_S;
    int rc = parse_flags(argc, argv, &o);
    if (rc >= 0) return rc;
    o.p.worker_urls = o.workers;
    o.p.prefill_urls = o.prefill;
    o.p.decode_urls = o.decode;
    char *token = NULL, *qos = NULL;
    struct event_base *base = NULL;
    pd_cmd_shutdown sd = {0};
    pd_router *r = NULL;
    rc = 1;
    if (o.token_file && !(token = read_token(o.token_file))) goto out;
    pd_err err = {0};
    if (o.qos_file && pd_file_read_all(o.qos_file, &qos, NULL, &err) != PD_OK) {
        fprintf(stderr, "pdserve router: %s\n", err.msg);
        goto out;
    }
    o.p.auth_token = token;
    o.p.qos_json = qos;
    signal(SIGPIPE, SIG_IGN);
    if (pd_trace_init("router", o.trace_dir, &err) != PD_OK) {
        fprintf(stderr, "pdserve router: %s\n", err.msg);
        goto out;
    }
    base = event_base_new();
    if (!base) goto out;
    r = pd_router_new(base, &o.p, &err);
    if (!r) {
        fprintf(stderr, "pdserve router: %s\n", err.msg);
        goto out;
    }
    sd.base = base;
    sd.who = "pdserve router";
    sd.timeout_s = o.shutdown_timeout_s;
    sd.ud = r;
    sd.drain = sd_drain;
    sd.is_drained = sd_is_drained;
    sd.end_all = sd_end_all;
    if (pd_cmd_shutdown_install(&sd)) goto out;
    printf("pdserve router listening on http://%s:%d (routing %s, %d workers)\n", o.p.host,
           pd_router_port(r), pd_router_routing_str(o.p.routing), o.p.n_workers + o.p.n_prefill + o.p.n_decode);
    fflush(stdout);
    event_base_dispatch(base);
    rc = 0;
out:
    pd_cmd_shutdown_fini(&sd);
    pd_router_free(r);
    if (base) event_base_free(base);
    pd_free(token);
    pd_free(qos);
    pd_trace_shutdown();
    if (rc == 0) fprintf(stderr, "pdserve router: stopped\n");
    return rc;
}
