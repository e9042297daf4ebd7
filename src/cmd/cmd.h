// cmd — the pdserve binary: subcommand dispatch and flag parsing. The only layer that may call
// exit(), parse argv or install signal handlers. Each subcommand lives in its own file and has
// the signature int pd_cmd_<name>(int argc, char **argv) returning the process exit code.
#pragma once
#include "base/base.h"

int pd_cmd_tokenize(int argc, char **argv);
int pd_cmd_generate(int argc, char **argv);
int pd_cmd_model_info(int argc, char **argv);
int pd_cmd_run(int argc, char **argv);
int pd_cmd_serve(int argc, char **argv);
int pd_cmd_router(int argc, char **argv);
int pd_cmd_bench_engine(int argc, char **argv);
int pd_cmd_bench_handoff(int argc, char **argv);
int pd_cmd_bench(int argc, char **argv);

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
