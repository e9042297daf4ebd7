// cmd — the pdserve binary: subcommand dispatch and flag parsing. The only layer that may call
// exit(), parse argv or install signal handlers. Each subcommand lives in its own file and has
// the signature int pd_cmd_<name>(int argc, char **argv) returning the process exit code.
#pragma once
#include "base/base.h"

struct event_base;
struct event;

int pd_cmd_tokenize(int argc, char **argv);
int pd_cmd_generate(int argc, char **argv);
int pd_cmd_model_info(int argc, char **argv);
int pd_cmd_nkey_gen(int argc, char **argv);
int pd_cmd_run(int argc, char **argv);
int pd_cmd_serve(int argc, char **argv);
int pd_cmd_router(int argc, char **argv);
int pd_cmd_bench_engine(int argc, char **argv);
int pd_cmd_bench_spec(int argc, char **argv);
int pd_cmd_bench_handoff(int argc, char **argv);
int pd_cmd_bench(int argc, char **argv);
int pd_cmd_env(int argc, char **argv);

// Minimal flag parsing shared by subcommands: --name value / --name=value / --flag.
typedef struct pd_flags {
    int argc;
    char **argv;
    int pos;          // next index
    const char *err;  // set on a parse error
} pd_flags;

// Returns the default model folder: $PDSERVE_MODEL, else models/kjv-llama-6m next to the binary's
// repository (build/../models), else ./models/kjv-llama-6m. Static storage.
const char *pd_cmd_default_model(const char *argv0);
// Prints "pdserve <cmd>: <msg>" to stderr; returns 2 (usage error exit code).
int pd_cmd_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Parses an integer / float flag value; false on error.
bool pd_cmd_parse_int(const char *s, long *out);
bool pd_cmd_parse_float(const char *s, double *out);

// Graceful shutdown of a serving event loop (shutdown.c): SIGTERM / SIGINT caught with evsignal on
// `base` (the loop thread; no async-signal-unsafe handler) → drain(ud); the loop exits once
// is_drained(ud), or timeout_s after the signal (or at a second signal) end_all(ud, msg) ends what
// is still running and the loop exits when those replies are written (at most 2 s later). The
// caller then frees everything and exits 0. Set the public fields, zero the rest, then install.
#define PD_CMD_SHUTDOWN_TIMEOUT_S 30
typedef struct pd_cmd_shutdown {
    struct event_base *base;
    const char *who;  // log prefix: "pdserve", "pdserve router"
    int timeout_s;    // --shutdown-timeout
    void *ud;
    void (*drain)(void *ud);
    bool (*is_drained)(void *ud);
    void (*end_all)(void *ud, const char *msg);
    // internal
    struct event *sigint, *sigterm, *tick;
    int n_signals;
    bool is_ended;
    int64_t t_signal_us, t_deadline_us, t_flush_deadline_us;
} pd_cmd_shutdown;
pd_status pd_cmd_shutdown_install(pd_cmd_shutdown *s);
void pd_cmd_shutdown_fini(pd_cmd_shutdown *s);
