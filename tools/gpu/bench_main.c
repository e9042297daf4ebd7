// bench_main.c — a stand-alone driver for `pdserve bench-engine` (src/cmd/bench_engine.c), for
// GPU runs while other subcommands of the full binary are still being written: links only the
// library and bench_engine.c. The two cmd helpers it needs mirror src/cmd/main.c.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "cmd/cmd.h"

int pd_cmd_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "pdserve %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return 2;
}

bool pd_cmd_parse_int(const char *s, long *out) {
    char *end;
    if (!s || !*s) return false;
    long v = strtol(s, &end, 10);
    if (*end) return false;
    *out = v;
    return true;
}

int main(int argc, char **argv) { return pd_cmd_bench_engine(argc, argv); }
