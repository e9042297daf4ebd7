// env.c — `pdserve env`: the environment knobs pdserve reads (base/knobs.h), what each accepts, and
// the value set in this environment. The check itself runs at every start (main.c), so a bad
// value makes `pdserve env` exit 2 like any other command.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/knobs.h"
#include "cmd/cmd.h"

static void accepts(const pd_knob *k, char *buf, size_t n) {
    switch (k->kind) {
    case PD_KNOB_SWITCH: snprintf(buf, n, "0|1"); break;
    case PD_KNOB_INT: snprintf(buf, n, "%.0f..%.0f", k->lo, k->hi); break;
    case PD_KNOB_FLOAT: snprintf(buf, n, "(%g, %g]", k->lo, k->hi); break;
    case PD_KNOB_CHOICE: snprintf(buf, n, "%s", k->choices); break;
    case PD_KNOB_TEXT: snprintf(buf, n, "text"); break;
    }
}

int pd_cmd_env(int argc, char **argv) {
    bool set_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--set")) set_only = true;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: pdserve env [--set]\n"
                   "  Lists the environment variables pdserve reads (measurement and A/B knobs, log level,\n"
                   "  default model), what each accepts and its value here. Every pdserve command checks them\n"
                   "  at start: a value outside what a knob accepts is refused (exit 2) with the variable\n"
                   "  named; an unknown variable of a pdserve family (PD_CUDA_*, PD_SPEC_*, PD_MODEL_*,\n"
                   "  PD_UCX_*, PDSERVE_*) is warned about with the nearest known name.\n"
                   "  --set  only the knobs set in this environment\n");
            return 0;
        } else return pd_cmd_usage_error("env", "unknown option '%s'", argv[i]);
    }
    size_t n;
    const pd_knob *k = pd_knobs(&n);
    for (size_t i = 0; i < n; i++) {
        const char *v = getenv(k[i].name);
        if (set_only && !v) continue;
        char acc[64];
        accepts(&k[i], acc, sizeof acc);
        printf("%-28s %-16s %-10s %s\n", k[i].name, acc, v ? v : "-", k[i].what);
    }
    return 0;
}
