// constrain.c — from a parsed request to what its sampler enforces: the grammar (response_format,
// grammar, or the tool-call syntax of a required / named tool choice), compiled once and cached
// by its text, and per choice a pd_sample_ctl holding the logit bias and a grammar matcher.
//
// The compiled grammars keep their per-position mask caches (grammar.h), so a schema that comes
// back (an agent's tool set, a client's response model) pays the mask precomputation once. The
// cache holds the 32 most recently used grammars; a grammar in use by running requests stays
// alive through their references when it leaves the cache.
#include <stdio.h>
#include <time.h>
#include <string.h>

#include "api/api_impl.h"

static uint64_t text_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

// A compiled grammar for text (a new reference), from the cache or compiled now.
static pd_grammar *grammar_get(pd_api *a, const char *text, pd_err *err) {
    uint64_t h = text_hash(text);
    int victim = 0;
    for (int i = 0; i < API_GCACHE_N; i++) {
        api_gcache *c = &a->gcache[i];
        if (c->g && c->hash == h && !strcmp(c->text, text)) {
            c->last_use = ++a->gcache_clock;
            return pd_grammar_ref(c->g);
        }
        if (!c->g || (a->gcache[victim].g && c->last_use < a->gcache[victim].last_use)) victim = i;
    }
    pd_grammar *g = pd_grammar_new(text, strlen(text), a->gvocab, err);
    if (!g) return NULL;
    char *copy = pd_strdup(text);
    if (copy) {  // cache it (a copy that cannot be made only costs a recompile later)
        api_gcache *c = &a->gcache[victim];
        pd_grammar_unref(c->g);
        pd_free(c->text);
        *c = (api_gcache){.hash = h, .text = copy, .g = pd_grammar_ref(g), .last_use = ++a->gcache_clock};
    }
    return g;
}

void pd_api_gcache_fini(pd_api *a) {
    for (int i = 0; i < API_GCACHE_N; i++) {
        pd_grammar_unref(a->gcache[i].g);
        pd_free(a->gcache[i].text);
    }
    memset(a->gcache, 0, sizeof a->gcache);
}

pd_status pd_api_constraint(pd_api *a, const pd_api_request *r, pd_grammar **out, pd_api_error *e) {
    *out = NULL;
    char *owned = NULL;
    const char *text = NULL, *param = "response_format";
    pd_err err = {0};
    pd_status st = PD_OK;
    if (r->tool_choice >= PD_API_TOOL_CHOICE_REQUIRED) {
        param = "tools";
        st = pd_api_tools_gbnf(r, r->tool_format, &owned, &err);
        text = owned;
    } else if (r->format == PD_API_FORMAT_JSON_OBJECT) {
        text = pd_grammar_json_gbnf();
    } else if (r->format == PD_API_FORMAT_JSON_SCHEMA) {
        st = pd_grammar_schema_to_gbnf(r->schema, &owned, &err);
        text = owned;
    } else if (r->format == PD_API_FORMAT_GRAMMAR) {
        param = "grammar";
        text = r->grammar;
    } else {
        return PD_OK;
    }
    if (!st && !a->gvocab) st = pd_err_set(&err, PD_ERR_INVALID, "constrained decoding is unavailable (no vocabulary)");
    if (!st) {
        *out = grammar_get(a, text, &err);
        if (!*out) st = err.status ? err.status : PD_ERR_NOMEM;
    }
    pd_free(owned);
    if (st) {
        e->status = st;
        snprintf(e->param, sizeof e->param, "%s", st == PD_ERR_INVALID ? param : "");
        snprintf(e->message, sizeof e->message, "%s", err.msg[0] ? err.msg : "out of memory");
        e->code = NULL;
    }
    return st;
}

// ---- the mask source of one choice -------------------------------------------------------------------

// Mask cost (CPU time of the engine thread), process-wide (a sampler, and so its matcher, may outlive the pd_api that made it).
static int64_t g_mask_ns, g_masks;

static int m_fill(void *ud, uint32_t *mask) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);  // CPU time: what the mask costs, whatever else runs
    int n = pd_grammar_matcher_fill_mask(ud, mask);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    __atomic_add_fetch(&g_mask_ns, (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec),
                       __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_masks, 1, __ATOMIC_RELAXED);
    return n;
}

void pd_api_mask_stats(double *seconds, double *count) {
    *seconds = (double)__atomic_load_n(&g_mask_ns, __ATOMIC_RELAXED) / 1e9;
    *count = (double)__atomic_load_n(&g_masks, __ATOMIC_RELAXED);
}
static pd_status m_accept(void *ud, int32_t t) { return pd_grammar_matcher_accept(ud, t); }
static void m_free(void *ud) { pd_grammar_matcher_free(ud); }
static const pd_token_mask_ops k_matcher_ops = {m_fill, m_accept, m_free};

pd_status pd_api_choice_ctl(pd_api *a, const pd_api_request *r, pd_grammar *g, const pd_tok_ids *prompt,
                            pd_sample_ctl **out) {
    *out = NULL;
    if (!g && !r->n_logit_bias) return PD_OK;
    pd_sample_ctl *c = pd_calloc(1, sizeof *c);
    if (!c) return PD_ERR_NOMEM;
    if (r->n_logit_bias) {
        c->bias = pd_malloc(sizeof(pd_logit_bias) * (size_t)r->n_logit_bias);
        if (!c->bias) goto oom;
        memcpy(c->bias, r->logit_bias, sizeof(pd_logit_bias) * (size_t)r->n_logit_bias);
        c->n_bias = r->n_logit_bias;
    }
    if (g) {
        // The tokens that end a sequence: the model's EOS ids, the tokenizer's, the request's stop ids.
        int32_t end[PD_API_MAX_STOP_IDS + 16];
        int n = 0;
        for (int i = 0; i < a->n_end_ids; i++) end[n++] = a->end_ids[i];
        for (int i = 0; i < r->n_stop_ids; i++) end[n++] = r->stop_ids[i];
        c->mask_ud = pd_grammar_matcher_new(g, end, n);
        if (!c->mask_ud) goto oom;
        c->mask_ops = &k_matcher_ops;
        // A failover continuation: the output so far ends the prompt; the grammar resumes after it.
        for (int i = prompt->n - r->continuation_tokens; r->continuation_tokens && i < prompt->n; i++)
            if (pd_grammar_matcher_accept(c->mask_ud, prompt->ids[i])) {
                pd_sample_ctl_free(c);
                return PD_ERR_INVALID;
            }
    }
    *out = c;
    return PD_OK;
oom:
    pd_sample_ctl_free(c);
    return PD_ERR_NOMEM;
}
