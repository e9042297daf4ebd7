// main.c — `pdserve <subcommand> [flags]`.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/knobs.h"
#include "cmd/cmd.h"

extern char **environ;

typedef struct subcmd {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} subcmd;

static const subcmd CMDS[] = {
    {"generate", pd_cmd_generate, "generate text from a prompt (offline, no server)"},
    {"tokenize", pd_cmd_tokenize, "print the token ids of a text as JSON"},
    {"bench-engine", pd_cmd_bench_engine, "time decode/prefill against the card's bandwidth and GEMM floors"},
    {"bench-spec", pd_cmd_bench_spec, "end-to-end decode speed with speculative decoding off / adaptive / fixed, by batch"},
    {"bench-handoff", pd_cmd_bench_handoff, "time the disaggregated prefill->decode KV handoff (two processes/GPUs)"},
    {"model-info", pd_cmd_model_info, "print architecture, parameter count, dtype, KV bytes per token"},
    {"serve", pd_cmd_serve, "start the OpenAI-compatible HTTP server"},
    {"router", pd_cmd_router, "OpenAI-compatible router over a pool of pdserve workers (KV-aware, SLO admission)"},
    {"run", pd_cmd_run, "prefill + decode workers + router for the bundled model on port 8000, supervised; a sample request"},
    {"nkey-gen", pd_cmd_nkey_gen, "make a NATS nkey user key pair (seed file + public key) for --control-nkey-seed"},
    {"bench", pd_cmd_bench, "benchmark an OpenAI-compatible server (latency, throughput, goodput; JSON/HTML reports)"},
    {"env", pd_cmd_env, "list the environment knobs pdserve reads, what each accepts, and their values here"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: pdserve <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < PD_ARRAY_LEN(CMDS); i++) fprintf(f, "  %-14s %s\n", CMDS[i].name, CMDS[i].help);
    fprintf(f, "\nRun 'pdserve <command> --help' for the options of one command.\n");
}

static void warn_unknown(const char *name, const pd_knob *nearest) {
    if (nearest) PD_LOG_W("%s is set but pdserve reads no such variable (did you mean %s?)", name, nearest->name);
    else PD_LOG_W("%s is set but pdserve reads no such variable ('pdserve env' lists them)", name);
}

int main(int argc, char **argv) {
    // The environment knobs first (base/knobs.h): a mistyped value is refused before anything
    // starts, instead of silently meaning the default where the knob is read.
    pd_err kerr = {0};
    if (pd_knobs_check_env(environ, NULL, warn_unknown, &kerr)) {
        fprintf(stderr, "pdserve: %s\n", kerr.msg);
        return 2;
    }
    const char *lvl = getenv("PDSERVE_LOG");
    if (lvl) pd_log_set_level(!strcmp(lvl, "debug") ? PD_LOG_DEBUG : !strcmp(lvl, "warn") ? PD_LOG_WARN : PD_LOG_INFO);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < PD_ARRAY_LEN(CMDS); i++)
        if (!strcmp(argv[1], CMDS[i].name)) return CMDS[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "pdserve: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

const char *pd_cmd_default_model(const char *argv0) {
    static char buf[4096];
    const char *env = getenv("PDSERVE_MODEL");
    if (env && *env) return env;
    // build/pdserve -> build/../models/kjv-llama-6m
    char exe[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            snprintf(buf, sizeof buf, "%s/../models/kjv-llama-6m", exe);
            if (access(buf, F_OK) == 0) return buf;
        }
    }
    (void)argv0;
    return "models/kjv-llama-6m";
}

int pd_cmd_usage_error(const char *cmd, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "pdserve %s: %s\n", cmd, msg);
    return 2;
}

bool pd_cmd_parse_int(const char *s, long *out) {
    if (!s || !*s) return false;
    char *end;
    long v = strtol(s, &end, 10);
    if (*end) return false;
    *out = v;
    return true;
}

bool pd_cmd_parse_float(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    double v = strtod(s, &end);
    if (*end) return false;
    *out = v;
    return true;
}
