// knobs.h — the registry of pdserve's environment variables (knobs): every variable the server,
// its backends and kernels read, with the values each accepts.
//
// Most knobs are measurement and A/B switches read lazily where they act (a kernel launcher, the
// engine's set-up); some parse their value loosely there. `pdserve` checks the whole environment
// against this table once at start (pd_knobs_check_env, from cmd/main.c), so that a mistyped value
// (PD_CUDA_PDL=2, PDSERVE_LOG=verbose) is refused with the variable named instead of silently
// meaning the default, and a variable of a pdserve family that no code reads (PD_CUDA_ATTN_WAVE
// for PD_CUDA_ATTN_WAVES) gets a warning with the nearest known name. `pdserve env` prints the
// table. tests/integration/test_env_knobs.sh checks that every knob name in src/ is registered.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "base/base.h"

typedef enum {
    PD_KNOB_SWITCH,  // "0" or "1"
    PD_KNOB_INT,     // a whole decimal number in [lo, hi]
    PD_KNOB_FLOAT,   // a decimal number in (lo, hi]
    PD_KNOB_CHOICE,  // one of the '|'-separated words in choices
    PD_KNOB_TEXT,    // any non-empty text (a path)
} pd_knob_kind;

typedef struct pd_knob {
    const char *name;
    pd_knob_kind kind;
    double lo, hi;        // PD_KNOB_INT: inclusive range; PD_KNOB_FLOAT: (lo, hi]
    const char *choices;  // PD_KNOB_CHOICE: "a|b|c"
    const char *what;     // one line: what it does, its default
} pd_knob;

// The table, sorted by name (n: its length).
const pd_knob *pd_knobs(size_t *n);
// The knob called name, or NULL.
const pd_knob *pd_knob_find(const char *name);
// Whether value is acceptable for k ("" counts as unset: acceptable). PD_ERR_INVALID with err
// naming the variable, its value and what it accepts otherwise.
pd_status pd_knob_check(const pd_knob *k, const char *value, pd_err *err);
// Whether name belongs to a family whose every variable is a knob (PD_CUDA_, PD_SPEC_, PD_MODEL_,
// PD_UCX_, PDSERVE_): an unknown name there is most likely a typo.
bool pd_knob_family(const char *name);
// The registered knob whose name is nearest to name (edit distance at most 3), or NULL.
const pd_knob *pd_knob_nearest(const char *name);
// Checks env (a NULL-terminated "NAME=VALUE" array, e.g. environ): the first knob with an
// unacceptable value is PD_ERR_INVALID (err says which); *n_unknown (if not NULL) counts the
// variables of a knob family that are not registered, and warn (if not NULL) is called once for
// each with its name and the nearest known knob (or NULL).
pd_status pd_knobs_check_env(char *const *env, int *n_unknown, void (*warn)(const char *name, const pd_knob *nearest),
                             pd_err *err);
