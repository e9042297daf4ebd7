// grammar_impl.h — the compiled grammar shared by gbnf.c (compiler) and match.c (recognizer).
//
// A grammar is a flat array of elements. Rule r has alternatives alts[alt_begin[r] ..
// alt_begin[r+1]), each the position of its first element; an alternative is a run of CLASS and
// RULE elements closed by an END element. A position (element index) names "what comes next".
#pragma once
#include <pthread.h>

#include "base/map.h"
#include "grammar/grammar.h"

enum { GE_END = 0, GE_CLASS = 1, GE_RULE = 2 };

typedef struct gelem {
    int32_t type;
    int32_t v;  // CLASS: class index; RULE: rule id
} gelem;

typedef struct gclass {
    uint64_t w[4];  // 256-bit byte set
} gclass;

static inline bool gclass_has(const gclass *c, unsigned b) { return (c->w[b >> 6] >> (b & 63)) & 1; }

// Per-position mask precomputation (match.c): tokens accepted whatever the stack below holds,
// and the tokens that leave the position's rule (checked against the real stack).
typedef struct gpos_cache {
    uint32_t *acc;   // mask words
    int32_t *unc;
    int n_unc;
} gpos_cache;

struct pd_grammar {
    int refs;
    const pd_grammar_vocab *vocab;
    gelem *elems;
    int n_elems;
    gclass *classes;
    int n_classes;
    int32_t *alt_begin;  // n_rules + 1
    int32_t *alts;
    int n_rules, root;
    pthread_mutex_t mu;
    gpos_cache **cache;  // n_elems, filled lazily under mu
    // The bytes that may follow each rule anywhere in the grammar (FOLLOW1), and the rule of each
    // element: tokens that leave a position's rule with a byte that cannot follow it are rejected
    // by the per-position precomputation instead of left uncertain (match.c). Under mu, lazily.
    gclass *follow;     // n_rules
    int32_t *rule_of;   // n_elems
    // Per-stack results of the uncertain tokens (match.c): the stack's positions, top first ->
    // the uncertain tokens it accepts. Filled lazily under mu, bounded (GRAMMAR_UCACHE_*).
    pd_map ucache;
    bool has_ucache;
    size_t ucache_n_toks;
    // Whole masks per state (a set of stacks), bounded by GRAMMAR_SCACHE_BYTES (match.c).
    pd_map scache;
    bool has_scache;
    size_t scache_bytes;
};

void pd_grammar_cache_free(pd_grammar *g);
