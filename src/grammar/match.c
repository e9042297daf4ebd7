// match.c — the recognizer and the token masks (see grammar.h).
//
// Stacks: a node is (position, parent node); the top of a live stack is always at a CLASS
// element. Nodes are hash-consed in an arena, so a state (a set of stacks) is a sorted set of
// node ids. NIL below the root: reaching it means the sentence is complete. BOTTOM is the
// sentinel the per-position precomputation puts under a position: reaching it means the token
// left the position's rule.
//
// Vocabulary trie: the token byte strings sorted, as a preorder array (byte, depth, end of
// subtree, the tokens that end at the node), so a walk is a loop over an array and skipping a
// subtree is a jump.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "base/map.h"
#include "grammar/grammar_impl.h"

#define NIL (-1)
#define BOTTOM (-2)

// ---- vocabulary trie -------------------------------------------------------------------------------

typedef struct tnode {
    uint8_t byte;
    uint16_t depth;   // 1 = first byte
    int32_t end;      // index after the subtree
    int32_t tok_begin, tok_n;  // into sorted ids
} tnode;

struct pd_grammar_vocab {
    int n_vocab, words;
    tnode *nodes;
    int n_nodes;
    int32_t *ids;     // tokens sorted by bytes (special and empty tokens left out)
    int n_ids;
    const char **bytes;  // per token (NULL: not text)
    int32_t *lens;
    int max_len;
};

static const pd_grammar_vocab *t_sort_vocab;
static int cmp_tok(const void *a, const void *b) {
    const pd_grammar_vocab *v = t_sort_vocab;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    int32_t lx = v->lens[x], ly = v->lens[y];
    int c = memcmp(v->bytes[x], v->bytes[y], (size_t)PD_MIN(lx, ly));
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

pd_grammar_vocab *pd_grammar_vocab_new(const pd_tok *tok, pd_err *err) {
    pd_grammar_vocab *v = pd_calloc(1, sizeof *v);
    if (!v) goto oom;
    int V = pd_tok_n_vocab(tok);
    v->n_vocab = V;
    v->words = (V + 31) / 32;
    v->bytes = pd_calloc((size_t)V, sizeof *v->bytes);
    v->lens = pd_calloc((size_t)V, sizeof *v->lens);
    v->ids = pd_malloc(sizeof(int32_t) * (size_t)V);
    if (!v->bytes || !v->lens || !v->ids) goto oom;
    size_t total = 0;
    for (int32_t t = 0; t < V; t++) {
        size_t n = 0;
        const char *b = pd_tok_token_bytes(tok, t, &n);
        if (!b || !n || pd_tok_is_special(tok, t) || n > 60000) continue;
        v->bytes[t] = b;
        v->lens[t] = (int32_t)n;
        v->ids[v->n_ids++] = t;
        total += n;
        if ((int)n > v->max_len) v->max_len = (int)n;
    }
    t_sort_vocab = v;  // NOTE: qsort has no context argument; vocab building is not concurrent
    qsort(v->ids, (size_t)v->n_ids, sizeof(int32_t), cmp_tok);
    v->nodes = pd_malloc(sizeof(tnode) * (total + 1));
    int32_t *path = pd_malloc(sizeof(int32_t) * (size_t)(v->max_len + 1));
    if (!v->nodes || !path) {
        pd_free(path);
        goto oom;
    }
    int depth = 0;  // nodes on the current path
    const char *prev = NULL;
    int prev_len = 0;
    for (int i = 0; i < v->n_ids; i++) {
        int32_t t = v->ids[i];
        const char *b = v->bytes[t];
        int n = v->lens[t], lcp = 0;
        while (lcp < n && lcp < prev_len && b[lcp] == prev[lcp]) lcp++;
        if (lcp == n && n == prev_len) {  // same bytes as the previous token
            v->nodes[path[depth - 1]].tok_n++;
            continue;
        }
        while (depth > lcp) v->nodes[path[--depth]].end = v->n_nodes;
        for (int k = lcp; k < n; k++) {
            tnode *nd = &v->nodes[v->n_nodes];
            *nd = (tnode){.byte = (uint8_t)b[k], .depth = (uint16_t)(k + 1), .end = -1, .tok_begin = i, .tok_n = 0};
            path[depth++] = v->n_nodes++;
        }
        v->nodes[path[depth - 1]].tok_begin = i;
        v->nodes[path[depth - 1]].tok_n = 1;
        prev = b;
        prev_len = n;
    }
    while (depth > 0) v->nodes[path[--depth]].end = v->n_nodes;
    pd_free(path);
    return v;
oom:
    pd_grammar_vocab_free(v);
    pd_err_set(err, PD_ERR_NOMEM, "grammar vocabulary: out of memory");
    return NULL;
}

void pd_grammar_vocab_free(pd_grammar_vocab *v) {
    if (!v) return;
    pd_free(v->nodes);
    pd_free(v->ids);
    pd_free(v->bytes);
    pd_free(v->lens);
    pd_free(v);
}

int pd_grammar_vocab_size(const pd_grammar_vocab *v) { return v->n_vocab; }
int pd_grammar_mask_words(const pd_grammar_vocab *v) { return v->words; }

// ---- stack arena -----------------------------------------------------------------------------------

typedef struct snode {
    int32_t pos, parent;
} snode;

typedef struct sarena {
    snode *n;
    int len;
    size_t cap;
    pd_map index;  // {pos, parent} -> node index (base/map.h); initialised on the first intern
    bool failed;   // out of memory: results are incomplete
} sarena;

typedef struct snode_key {
    int32_t pos, parent;
} snode_key;
typedef struct sindex_entry {
    snode_key key;
    int32_t node;
} sindex_entry;

static uint64_t node_hash(snode_key k) { return pd_map_mix64((uint64_t)(uint32_t)k.pos << 32 | (uint32_t)k.parent); }

static int32_t intern(sarena *a, int32_t pos, int32_t parent) {
    if (!a->index.stride &&
        pd_map_init(&a->index, &(pd_map_params){.entry_size = sizeof(sindex_entry), .key_size = sizeof(snode_key)})) {
        a->failed = true;
        return NIL;
    }
    snode_key k = {pos, parent};
    uint64_t h = node_hash(k);
    const sindex_entry *f = pd_map_find(&a->index, h, &k);
    if (f) return f->node;
    if (PD_ARRAY_RESERVE(a->n, a->cap, (size_t)a->len + 1)) {
        a->failed = true;
        return NIL;
    }
    sindex_entry *e = pd_map_put(&a->index, h, &k, NULL);
    if (!e) {
        a->failed = true;
        return NIL;
    }
    e->node = a->len;
    a->n[a->len] = (snode){pos, parent};
    return a->len++;
}

static void arena_fini(sarena *a) {
    pd_free(a->n);
    pd_map_fini(&a->index);
    memset(a, 0, sizeof *a);
}

// ---- states ----------------------------------------------------------------------------------------

typedef struct sstate {
    int32_t *tops;
    int n;
    size_t cap;
    bool accepting;   // a path reached NIL (the sentence can end here)
    bool hit_bottom;  // a path reached BOTTOM (left the precomputed position's rule)
} sstate;

static void state_add(sarena *a, sstate *s, int32_t node) {
    if (PD_ARRAY_RESERVE(s->tops, s->cap, (size_t)s->n + 1)) {
        a->failed = true;
        return;
    }
    s->tops[s->n++] = node;
}

// Closes position pos (with the given parent) into top nodes at CLASS elements.
static void expand(const pd_grammar *g, sarena *a, int32_t pos, int32_t parent, sstate *out, int depth) {
    for (;;) {
        const gelem *e = &g->elems[pos];
        if (e->type == GE_CLASS) {
            int32_t x = intern(a, pos, parent);
            if (x >= 0) state_add(a, out, x);
            return;
        }
        if (e->type == GE_END) {
            if (parent == NIL) {
                out->accepting = true;
                return;
            }
            if (parent == BOTTOM) {
                out->hit_bottom = true;
                return;
            }
            pos = a->n[parent].pos;
            parent = a->n[parent].parent;
            continue;
        }
        // RULE: push the return position unless it is the end of the alternative (a tail call).
        if (depth > 4096) {  // cannot happen without left recursion, which the compiler refuses
            a->failed = true;
            return;
        }
        int32_t ret = parent;
        if (g->elems[pos + 1].type != GE_END) ret = intern(a, pos + 1, parent);
        if (a->failed) return;
        int r = e->v;
        for (int k = g->alt_begin[r]; k < g->alt_begin[r + 1]; k++) expand(g, a, g->alts[k], ret, out, depth + 1);
        return;
    }
}

static int cmp_i32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

static void state_unique(sstate *s) {
    if (s->n < 2) return;
    qsort(s->tops, (size_t)s->n, sizeof(int32_t), cmp_i32);
    int k = 1;
    for (int i = 1; i < s->n; i++)
        if (s->tops[i] != s->tops[k - 1]) s->tops[k++] = s->tops[i];
    s->n = k;
}

// out = in advanced by byte b.
static void advance(const pd_grammar *g, sarena *a, const int32_t *tops, int n, uint8_t b, sstate *out) {
    out->n = 0;
    out->accepting = out->hit_bottom = false;
    for (int i = 0; i < n; i++) {
        snode s = a->n[tops[i]];
        if (gclass_has(&g->classes[g->elems[s.pos].v], b)) expand(g, a, s.pos + 1, s.parent, out, 0);
    }
    state_unique(out);
}

// ---- per-position precomputation -------------------------------------------------------------------

static void set_bit(uint32_t *m, int32_t t) { m[t >> 5] |= 1u << (t & 31); }

static bool unc_push(gpos_cache *pc, size_t *cap, int32_t t) {
    if (PD_ARRAY_RESERVE(pc->unc, *cap, (size_t)pc->n_unc + 1)) return false;
    pc->unc[pc->n_unc++] = t;
    return true;
}

// ---- FOLLOW1 of each rule ----------------------------------------------------------------------------
// Textbook nullable / FIRST1 / FOLLOW1 fixpoints over the flat grammar. A token whose walk leaves
// the rule of the position being precomputed (the BOTTOM sentinel) with more bytes to go can only
// be accepted if its next byte may follow that rule in some context: FOLLOW1 is a superset of what
// any real stack below allows, so a token rejected by it is rejected by every stack.
static void gclass_or(gclass *a, const gclass *b, bool *changed) {
    for (int i = 0; i < 4; i++) {
        uint64_t x = a->w[i] | b->w[i];
        if (x != a->w[i]) a->w[i] = x, *changed = true;
    }
}

// FIRST1 of the elements from p to the alternative's END into *first; returns whether they are
// nullable (may consume nothing).
static bool seq_first(const pd_grammar *g, const gclass *first_r, const bool *nullable, int32_t p, gclass *first) {
    for (;; p++) {
        const gelem *e = &g->elems[p];
        if (e->type == GE_END) return true;
        bool ch = false;
        if (e->type == GE_CLASS) {
            gclass_or(first, &g->classes[e->v], &ch);
            return false;
        }
        gclass_or(first, &first_r[e->v], &ch);
        if (!nullable[e->v]) return false;
    }
}

static bool compute_follow(pd_grammar *g) {
    int R = g->n_rules;
    bool *nullable = pd_calloc((size_t)R, sizeof(bool));
    gclass *first = pd_calloc((size_t)R, sizeof(gclass));
    g->follow = pd_calloc((size_t)R, sizeof(gclass));
    g->rule_of = pd_malloc(sizeof(int32_t) * (size_t)g->n_elems);
    if (!nullable || !first || !g->follow || !g->rule_of) {
        pd_free(nullable);
        pd_free(first);
        pd_free(g->follow);
        pd_free(g->rule_of);
        g->follow = NULL;
        g->rule_of = NULL;
        return false;
    }
    for (int i = 0; i < g->n_elems; i++) g->rule_of[i] = -1;
    for (int r = 0; r < R; r++)
        for (int k = g->alt_begin[r]; k < g->alt_begin[r + 1]; k++) {
            int32_t p = g->alts[k];
            for (; g->elems[p].type != GE_END; p++) g->rule_of[p] = r;
            g->rule_of[p] = r;
        }
    for (bool changed = true; changed;) {  // nullable and FIRST1
        changed = false;
        for (int r = 0; r < R; r++)
            for (int k = g->alt_begin[r]; k < g->alt_begin[r + 1]; k++) {
                gclass f = first[r];
                bool nul = seq_first(g, first, nullable, g->alts[k], &f);
                gclass_or(&first[r], &f, &changed);
                if (nul && !nullable[r]) nullable[r] = changed = true;
            }
    }
    for (bool changed = true; changed;) {  // FOLLOW1
        changed = false;
        for (int q = 0; q < R; q++)
            for (int k = g->alt_begin[q]; k < g->alt_begin[q + 1]; k++)
                for (int32_t p = g->alts[k]; g->elems[p].type != GE_END; p++) {
                    if (g->elems[p].type != GE_RULE) continue;
                    int r = g->elems[p].v;
                    gclass f = {{0}};
                    bool nul = seq_first(g, first, nullable, p + 1, &f);
                    gclass_or(&g->follow[r], &f, &changed);
                    if (nul) gclass_or(&g->follow[r], &g->follow[q], &changed);
                }
    }
    pd_free(nullable);
    pd_free(first);
    return true;
}

static gpos_cache *precompute(const pd_grammar *g, int32_t pos) {
    const pd_grammar_vocab *v = g->vocab;
    gpos_cache *pc = pd_calloc(1, sizeof *pc);
    sarena a = {0};
    int D = v->max_len + 1;
    size_t cap_unc = 0;
    sstate *st = pd_calloc((size_t)D, sizeof *st);
    bool *unc_below = pd_calloc((size_t)D, sizeof(bool));  // U: left the rule at a shorter prefix
    bool ok = pc && st && unc_below && (pc->acc = pd_calloc((size_t)v->words, sizeof(uint32_t)));
    // bytes that may come after the position's rule (without FOLLOW1, after OOM: any byte)
    static const gclass k_any = {{~0ull, ~0ull, ~0ull, ~0ull}};
    const gclass *fol = g->follow && g->rule_of[pos] >= 0 ? &g->follow[g->rule_of[pos]] : &k_any;
    if (ok) {
        int32_t x = intern(&a, pos, BOTTOM);
        state_add(&a, &st[0], x);
        for (int i = 0; i < v->n_nodes && ok && !a.failed;) {
            const tnode *nd = &v->nodes[i];
            int d = nd->depth;
            sstate *s = &st[d];
            advance(g, &a, st[d - 1].tops, st[d - 1].n, nd->byte, s);
            // uncertain: a path left the rule at a shorter prefix with a byte that may follow it
            bool u = d > 1 && (unc_below[d - 1] || (st[d - 1].hit_bottom && gclass_has(fol, nd->byte)));
            unc_below[d] = u;
            bool acc = s->n > 0 || s->hit_bottom;
            for (int k = 0; k < nd->tok_n; k++) {
                int32_t t = v->ids[nd->tok_begin + k];
                if (acc) set_bit(pc->acc, t);
                else if (u) ok = ok && unc_push(pc, &cap_unc, t);
            }
            if (s->n > 0) {
                i++;
                continue;
            }
            // every longer token left the rule: the real stack decides, unless the byte after
            // the rule's end cannot follow the rule anywhere
            if (u || s->hit_bottom)
                for (int j = i + 1; j < nd->end && ok; j++)
                    for (int k = 0; k < v->nodes[j].tok_n && ok; k++) {
                        int32_t t = v->ids[v->nodes[j].tok_begin + k];
                        if (u || gclass_has(fol, (uint8_t)v->bytes[t][d])) ok = unc_push(pc, &cap_unc, t);
                    }
            i = nd->end;
        }
    }
    ok = ok && !a.failed;
    for (int d = 0; st && d < D; d++) pd_free(st[d].tops);
    pd_free(st);
    pd_free(unc_below);
    arena_fini(&a);
    if (!ok && pc) {
        pd_free(pc->acc);
        pd_free(pc->unc);
        pd_free(pc);
        return NULL;
    }
    return pc;
}

static const gpos_cache *pos_cache(pd_grammar *g, int32_t pos) {
    gpos_cache *pc = __atomic_load_n(&g->cache[pos], __ATOMIC_ACQUIRE);
    if (pc) return pc;
    pthread_mutex_lock(&g->mu);
    pc = g->cache[pos];
    if (!pc) {
        if (!g->follow) (void)compute_follow(g);  // without it (OOM) every leaving token stays uncertain
        pc = precompute(g, pos);
        if (pc) __atomic_store_n(&g->cache[pos], pc, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g->mu);
    return pc;
}

// ---- per-stack cache of the uncertain tokens ------------------------------------------------------
// The uncertain tokens of a position are checked against the real stack below it, and that check
// depends only on the stack's positions (top to root). The same stacks come back step after step
// (every token inside a JSON string is under the same stack) and across the sequences that share a
// grammar, so the accepted ones are cached per stack in the grammar: a step then costs the OR of
// the cached per-position masks and a few bits, not a walk. Bounded: stacks deeper than
// GRAMMAR_UCACHE_DEPTH (deep recursion) are not cached; past GRAMMAR_UCACHE_ENTRIES stacks or
// GRAMMAR_UCACHE_TOKS tokens in all, new results are computed each time and not kept.
#define GRAMMAR_UCACHE_DEPTH 64
#define GRAMMAR_UCACHE_ENTRIES 16384
#define GRAMMAR_UCACHE_TOKS (4u << 20)

typedef struct ucache_key {
    const int32_t *pos;
    int n;
} ucache_key;

typedef struct ucache_entry {
    int32_t *pos;   // n positions, top first
    int32_t *toks;  // n_toks accepted uncertain tokens
    int n, n_toks;
} ucache_entry;

static bool ucache_eq(const void *entry, const void *key, void *ctx) {
    PD_UNUSED(ctx);
    const ucache_entry *e = entry;
    const ucache_key *k = key;
    return e->n == k->n && !memcmp(e->pos, k->pos, sizeof(int32_t) * (size_t)k->n);
}

static uint64_t ucache_hash(const int32_t *pos, int n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    for (int i = 0; i < n; i++) h = pd_map_mix64(h ^ (uint32_t)pos[i]);
    return h;
}

static void ucache_free(pd_grammar *g) {
    if (!g->has_ucache) return;
    for (size_t i = 0; i < g->ucache.cap; i++) {
        ucache_entry *e = pd_map_slot(&g->ucache, i);
        if (!e) continue;
        pd_free(e->pos);
        pd_free(e->toks);
    }
    pd_map_fini(&g->ucache);
    g->has_ucache = false;
}

static void scache_free(pd_grammar *g);

void pd_grammar_cache_free(pd_grammar *g) {
    pd_free(g->follow);
    pd_free(g->rule_of);
    ucache_free(g);
    scache_free(g);
    for (int i = 0; i < g->n_elems; i++) {
        if (!g->cache[i]) continue;
        pd_free(g->cache[i]->acc);
        pd_free(g->cache[i]->unc);
        pd_free(g->cache[i]);
    }
    pd_free(g->cache);
}

// ---- matcher ---------------------------------------------------------------------------------------

struct pd_grammar_matcher {
    pd_grammar *g;
    sarena a;
    sstate cur, tmp[2];
    sstate *dst;  // per depth (vocab max_len + 1): the uncertain-token walk
    int32_t *end_ids;
    int n_end;
    bool ended;  // an end token was accepted
    int32_t *ulist;  // the accepted uncertain tokens of one check (cap_ulist)
    size_t cap_ulist;
    int32_t *kbuf;   // the state's key (state_key)
    size_t cap_kbuf;
};

static void state_copy(sarena *a, sstate *dst, const sstate *src) {
    dst->n = 0;
    for (int i = 0; i < src->n; i++) state_add(a, dst, src->tops[i]);
    dst->accepting = src->accepting;
    dst->hit_bottom = false;
}

pd_grammar_matcher *pd_grammar_matcher_new(pd_grammar *g, const int32_t *end_ids, int n_end) {
    pd_grammar_matcher *m = pd_calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = pd_grammar_ref(g);
    m->end_ids = pd_malloc(sizeof(int32_t) * (size_t)(n_end > 0 ? n_end : 1));
    if (!m->end_ids) {
        pd_grammar_matcher_free(m);
        return NULL;
    }
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] >= 0 && end_ids[i] < g->vocab->n_vocab) m->end_ids[m->n_end++] = end_ids[i];
    for (int k = g->alt_begin[g->root]; k < g->alt_begin[g->root + 1]; k++) expand(g, &m->a, g->alts[k], NIL, &m->cur, 0);
    state_unique(&m->cur);
    if (m->a.failed) {
        pd_grammar_matcher_free(m);
        return NULL;
    }
    return m;
}

void pd_grammar_matcher_free(pd_grammar_matcher *m) {
    if (!m) return;
    arena_fini(&m->a);
    pd_free(m->cur.tops);
    pd_free(m->tmp[0].tops);
    pd_free(m->tmp[1].tops);
    for (int d = 0; m->dst && d <= m->g->vocab->max_len; d++) pd_free(m->dst[d].tops);
    pd_free(m->dst);
    pd_free(m->end_ids);
    pd_free(m->ulist);
    pd_free(m->kbuf);
    pd_grammar_unref(m->g);
    pd_free(m);
}

// Runs bytes from the state (tops, n); the result lands in m->tmp[*which]. False when every path
// died (or the sentence completed before the bytes ran out).
static bool run_bytes(pd_grammar_matcher *m, const int32_t *tops, int n, const uint8_t *b, int len, int *which) {
    const int32_t *in = tops;
    int in_n = n, w = 0;
    for (int i = 0; i < len; i++) {
        sstate *out = &m->tmp[w];
        advance(m->g, &m->a, in, in_n, b[i], out);
        if (!out->n && !(out->accepting && i == len - 1)) return false;
        in = out->tops;
        in_n = out->n;
        *which = w;
        w ^= 1;
    }
    return len > 0;
}

static bool is_end(const pd_grammar_matcher *m, int32_t t) {
    for (int i = 0; i < m->n_end; i++)
        if (m->end_ids[i] == t) return true;
    return false;
}

// Sets the uncertain tokens of pc that the real stack `top` accepts. The list is in trie order, so
// consecutive tokens share prefixes: the states per depth are reused up to the common prefix, and
// once a prefix dies every following token that starts with it is skipped without work.
static void check_uncertain(pd_grammar_matcher *m, int32_t top, const gpos_cache *pc, uint32_t *mask,
                            int32_t *out, int *n_out) {
    const pd_grammar_vocab *v = m->g->vocab;
    *n_out = 0;
    if (!pc->n_unc) return;
    if (!m->dst && !(m->dst = pd_calloc((size_t)v->max_len + 1, sizeof(sstate)))) return;
    sstate *st = m->dst;
    st[0].n = 0;
    state_add(&m->a, &st[0], top);
    int valid = 0, dead = INT32_MAX, plen = 0;
    const uint8_t *pb = NULL;
    bool prev_ok = false;
    for (int k = 0; k < pc->n_unc; k++) {
        int32_t t = pc->unc[k];
        const uint8_t *b = (const uint8_t *)v->bytes[t];
        int n = v->lens[t], l = 0;
        while (l < n && l < plen && b[l] == pb[l]) l++;
        if (l == n && n == plen) {  // the same bytes as the previous token
            if (prev_ok) set_bit(mask, t), out[(*n_out)++] = t;
            continue;
        }
        prev_ok = false;
        if (dead <= l) continue;  // shares a prefix that already died
        if (valid > l) valid = l;
        dead = INT32_MAX;
        pb = b;
        plen = n;
        bool ok = false;
        for (int d = valid + 1; d <= n; d++) {
            advance(m->g, &m->a, st[d - 1].tops, st[d - 1].n, b[d - 1], &st[d]);
            valid = d;
            if (!st[d].n) {
                dead = d;
                ok = d == n && st[d].accepting;
                break;
            }
            if (d == n) ok = true;
        }
        if (valid == n && dead == INT32_MAX && n > 0) ok = st[n].n > 0 || st[n].accepting;
        if (ok) set_bit(mask, t), out[(*n_out)++] = t;
        prev_ok = ok;
        if (m->a.failed) return;
    }
}

// Sets the uncertain tokens of pc that the stack `top` accepts, from the grammar's per-stack cache
// or by check_uncertain (whose result is then cached).
static bool uncertain_mask(pd_grammar_matcher *m, int32_t top, const gpos_cache *pc, uint32_t *mask) {
    pd_grammar *g = m->g;
    if (!pc->n_unc) return true;
    int32_t key[GRAMMAR_UCACHE_DEPTH];
    int n = 0;
    int32_t x = top;
    for (; x != NIL && n < GRAMMAR_UCACHE_DEPTH; x = m->a.n[x].parent) key[n++] = m->a.n[x].pos;
    bool cacheable = x == NIL;
    ucache_key k = {key, n};
    uint64_t h = cacheable ? ucache_hash(key, n) : 0;
    if (cacheable) {
        const int32_t *toks = NULL;
        int n_toks = 0;
        pthread_mutex_lock(&g->mu);
        const ucache_entry *e = g->has_ucache ? pd_map_find(&g->ucache, h, &k) : NULL;
        if (e) toks = e->toks, n_toks = e->n_toks;  // immutable once stored, freed with g
        pthread_mutex_unlock(&g->mu);
        if (e) {
            for (int i = 0; i < n_toks; i++) set_bit(mask, toks[i]);
            return true;
        }
    }
    if (m->cap_ulist < (size_t)pc->n_unc) {
        pd_free(m->ulist);
        m->cap_ulist = 0;
        if (!(m->ulist = pd_malloc(sizeof(int32_t) * (size_t)pc->n_unc))) return false;  // fewer tokens, never a wrong one
        m->cap_ulist = (size_t)pc->n_unc;
    }
    int n_acc = 0;
    check_uncertain(m, top, pc, mask, m->ulist, &n_acc);
    if (m->a.failed) return false;
    if (!cacheable) return true;
    pthread_mutex_lock(&g->mu);
    if (!g->has_ucache) {
        pd_map_params mp = {.entry_size = sizeof(ucache_entry), .eq = ucache_eq};
        g->has_ucache = pd_map_init(&g->ucache, &mp) == PD_OK;
    }
    if (g->has_ucache && pd_map_len(&g->ucache) < GRAMMAR_UCACHE_ENTRIES &&
        g->ucache_n_toks + (size_t)n_acc <= GRAMMAR_UCACHE_TOKS && !pd_map_find(&g->ucache, h, &k)) {
        int32_t *pos = pd_malloc(sizeof(int32_t) * (size_t)n);
        int32_t *toks = pd_malloc(sizeof(int32_t) * (size_t)(n_acc > 0 ? n_acc : 1));
        ucache_entry *e = pos && toks ? pd_map_put(&g->ucache, h, &k, NULL) : NULL;
        if (e) {
            memcpy(pos, key, sizeof(int32_t) * (size_t)n);
            memcpy(toks, m->ulist, sizeof(int32_t) * (size_t)n_acc);
            *e = (ucache_entry){pos, toks, n, n_acc};
            g->ucache_n_toks += (size_t)n_acc;
        } else {
            pd_free(pos);
            pd_free(toks);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return true;
}

// ---- per-state cache of whole masks ---------------------------------------------------------------
// A matcher's state is a set of stacks; the grammar's part of its mask (everything but the end
// tokens, which depend on the matcher's end ids and on whether the state accepts) depends only on
// those stacks' positions. Steady decoding revisits few states (inside a string, between members,
// inside a number), so the whole mask of a state is cached in the grammar and a step becomes one
// copy of the mask. The key is the state's stacks, each as its positions top first, in a canonical
// order (sorted). Bounded by GRAMMAR_SCACHE_BYTES of masks per grammar (the first states seen are
// kept); states with a stack deeper than GRAMMAR_UCACHE_DEPTH are not cached.
#define GRAMMAR_SCACHE_BYTES ((size_t)8 << 20)

typedef struct scache_entry {
    int32_t *key;
    uint32_t *mask;  // vocab words
    int n_key, n_allowed;
} scache_entry;

static bool scache_eq(const void *entry, const void *key, void *ctx) {
    PD_UNUSED(ctx);
    const scache_entry *e = entry;
    const ucache_key *k = key;
    return e->n_key == k->n && !memcmp(e->key, k->pos, sizeof(int32_t) * (size_t)k->n);
}

static void scache_free(pd_grammar *g) {
    if (!g->has_scache) return;
    for (size_t i = 0; i < g->scache.cap; i++) {
        scache_entry *e = pd_map_slot(&g->scache, i);
        if (!e) continue;
        pd_free(e->key);
        pd_free(e->mask);
    }
    pd_map_fini(&g->scache);
    g->has_scache = false;
}

// Compares two stacks (chains of positions in kbuf: length, then positions).
static int chain_cmp(const int32_t *a, const int32_t *b) {
    int n = PD_MIN(a[0], b[0]);
    for (int i = 1; i <= n; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

// The state's key in m->kbuf[0 .. return): its stacks, each as (length, positions top first),
// sorted. -1 when a stack is too deep to key (or out of memory).
static int state_key(pd_grammar_matcher *m) {
    int n_tops = m->cur.n;
    size_t need = (size_t)n_tops * (GRAMMAR_UCACHE_DEPTH + 1) * 2 + (size_t)n_tops;
    if (m->cap_kbuf < need) {
        pd_free(m->kbuf);
        m->cap_kbuf = 0;
        if (!(m->kbuf = pd_malloc(sizeof(int32_t) * need))) return -1;
        m->cap_kbuf = need;
    }
    // chains at kbuf[half ..], their offsets after them; the sorted key is written at kbuf[0 ..]
    int32_t *chains = m->kbuf + (size_t)n_tops * (GRAMMAR_UCACHE_DEPTH + 1);
    int32_t *off = m->kbuf + (size_t)n_tops * (GRAMMAR_UCACHE_DEPTH + 1) * 2;
    int len = 0;
    for (int i = 0; i < n_tops; i++) {
        off[i] = len;
        int32_t *c = chains + len, n = 0, x = m->cur.tops[i];
        for (; x != NIL && n < GRAMMAR_UCACHE_DEPTH; x = m->a.n[x].parent) c[1 + n++] = m->a.n[x].pos;
        if (x != NIL) return -1;
        c[0] = n;
        len += n + 1;
    }
    for (int i = 1; i < n_tops; i++)  // insertion sort of the offsets by chain (a state has few stacks)
        for (int j = i; j > 0 && chain_cmp(chains + off[j - 1], chains + off[j]) > 0; j--) {
            int32_t t = off[j];
            off[j] = off[j - 1];
            off[j - 1] = t;
        }
    int k = 0;
    for (int i = 0; i < n_tops; i++) {
        const int32_t *c = chains + off[i];
        memcpy(m->kbuf + k, c, sizeof(int32_t) * (size_t)(c[0] + 1));
        k += c[0] + 1;
    }
    return k;
}

int pd_grammar_matcher_fill_mask(pd_grammar_matcher *m, uint32_t *mask) {
    pd_grammar *g = m->g;
    const pd_grammar_vocab *v = g->vocab;
    size_t bytes = sizeof(uint32_t) * (size_t)v->words;
    int n_allowed = 0;
    if (m->ended) {
        memset(mask, 0, bytes);
    } else {
        int nk = state_key(m);
        ucache_key k = {m->kbuf, nk};
        uint64_t h = nk >= 0 ? ucache_hash(m->kbuf, nk) : 0;
        const scache_entry *e = NULL;
        if (nk >= 0) {
            pthread_mutex_lock(&g->mu);
            e = g->has_scache ? pd_map_find(&g->scache, h, &k) : NULL;
            const uint32_t *cached = e ? e->mask : NULL;  // immutable once stored, freed with g
            if (e) n_allowed = e->n_allowed;
            pthread_mutex_unlock(&g->mu);
            if (cached) memcpy(mask, cached, bytes);
        }
        if (!e) {
            memset(mask, 0, bytes);
            bool whole = true;
            for (int i = 0; i < m->cur.n; i++) {
                int32_t top = m->cur.tops[i];
                const gpos_cache *pc = pos_cache(g, m->a.n[top].pos);
                if (!pc) {  // out of memory: fewer tokens allowed, never a wrong one
                    whole = false;
                    continue;
                }
                for (int w = 0; w < v->words; w++) mask[w] |= pc->acc[w];
                whole = uncertain_mask(m, top, pc, mask) && whole;
            }
            for (int w = 0; w < v->words; w++) n_allowed += __builtin_popcount(mask[w]);
            if (whole && nk >= 0) {
                pthread_mutex_lock(&g->mu);
                if (!g->has_scache) {
                    pd_map_params mp = {.entry_size = sizeof(scache_entry), .eq = scache_eq};
                    g->has_scache = pd_map_init(&g->scache, &mp) == PD_OK;
                }
                if (g->has_scache && g->scache_bytes + bytes <= GRAMMAR_SCACHE_BYTES && !pd_map_find(&g->scache, h, &k)) {
                    int32_t *key = pd_malloc(sizeof(int32_t) * (size_t)(nk > 0 ? nk : 1));
                    uint32_t *copy = pd_malloc(bytes);
                    scache_entry *ne = key && copy ? pd_map_put(&g->scache, h, &k, NULL) : NULL;
                    if (ne) {
                        memcpy(key, m->kbuf, sizeof(int32_t) * (size_t)nk);
                        memcpy(copy, mask, bytes);
                        *ne = (scache_entry){key, copy, nk, n_allowed};
                        g->scache_bytes += bytes;
                    } else {
                        pd_free(key);
                        pd_free(copy);
                    }
                }
                pthread_mutex_unlock(&g->mu);
            }
        }
        if (m->cur.accepting)
            for (int i = 0; i < m->n_end; i++) {
                int32_t t = m->end_ids[i];
                if (!((mask[t >> 5] >> (t & 31)) & 1)) set_bit(mask, t), n_allowed++;
            }
    }
    if (!n_allowed)  // stuck (the vocabulary cannot spell what is required): let the sequence end
        for (int i = 0; i < m->n_end; i++) set_bit(mask, m->end_ids[i]), n_allowed = 0;
    return n_allowed;
}

// Keeps the arena small: after a few thousand scratch nodes, re-intern only the live stacks.
static void compact(pd_grammar_matcher *m) {
    if (m->a.len < 16384) return;
    sarena na = {0};
    int32_t *map = pd_malloc(sizeof(int32_t) * (size_t)m->a.len);
    if (!map) return;
    int32_t *tops = pd_malloc(sizeof(int32_t) * (size_t)(m->cur.n ? m->cur.n : 1));
    if (!tops) {
        pd_free(map);
        return;
    }
    for (int i = 0; i < m->a.len; i++) map[i] = -3;
    for (int i = 0; i < m->cur.n; i++) {
        // Copy each top's chain root-first (chains are as deep as the grammar's nesting).
        int32_t chain[4096];
        int n = 0;
        for (int32_t x = m->cur.tops[i]; x >= 0 && map[x] == -3 && n < 4096; x = m->a.n[x].parent) chain[n++] = x;
        if (n == 4096) na.failed = true;
        while (n--) {
            int32_t x = chain[n], p = m->a.n[x].parent;
            map[x] = intern(&na, m->a.n[x].pos, p >= 0 ? map[p] : p);
        }
        tops[i] = map[m->cur.tops[i]];
    }
    pd_free(map);
    if (na.failed) {  // keep the old arena: correct, only larger
        arena_fini(&na);
        pd_free(tops);
        return;
    }
    memcpy(m->cur.tops, tops, sizeof(int32_t) * (size_t)m->cur.n);
    pd_free(tops);
    arena_fini(&m->a);
    m->a = na;
    state_unique(&m->cur);
}

pd_status pd_grammar_matcher_accept_bytes(pd_grammar_matcher *m, const char *s, size_t n) {
    if (m->ended) return PD_ERR_INVALID;
    if (!n) return PD_OK;
    int which = 0;
    if (!run_bytes(m, m->cur.tops, m->cur.n, (const uint8_t *)s, (int)n, &which)) return PD_ERR_INVALID;
    state_copy(&m->a, &m->cur, &m->tmp[which]);
    if (m->a.failed) return PD_ERR_NOMEM;
    compact(m);
    return PD_OK;
}

pd_status pd_grammar_matcher_accept(pd_grammar_matcher *m, int32_t t) {
    const pd_grammar_vocab *v = m->g->vocab;
    if (m->ended || t < 0 || t >= v->n_vocab) return PD_ERR_INVALID;
    if (is_end(m, t)) {
        if (!m->cur.accepting) return PD_ERR_INVALID;
        m->ended = true;
        return PD_OK;
    }
    if (!v->bytes[t]) return PD_ERR_INVALID;
    return pd_grammar_matcher_accept_bytes(m, v->bytes[t], (size_t)v->lens[t]);
}

bool pd_grammar_matcher_can_accept_bytes(pd_grammar_matcher *m, const char *s, size_t n) {
    int which = 0;
    return !m->ended && n && run_bytes(m, m->cur.tops, m->cur.n, (const uint8_t *)s, (int)n, &which);
}

bool pd_grammar_matcher_is_accepting(const pd_grammar_matcher *m) { return !m->ended && m->cur.accepting; }
bool pd_grammar_matcher_is_done(const pd_grammar_matcher *m) { return m->ended || (m->cur.accepting && m->cur.n == 0); }
