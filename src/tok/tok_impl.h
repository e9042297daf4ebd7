// tok_impl.h — internal structures of the tokenizer, shared by src/tok/tok_*.c only.
//
// Layout of a loaded pd_tok:
//
//   pool     one char buffer holding every string (token strings, token bytes, added-token
//            contents, normalizer/decoder literals), each NUL-terminated; referenced by offset
//   tokens   per id: vocabulary string, raw bytes, flags (holes in the id space have no flags)
//   vocab    hash map string → id over the model vocabulary; added: same over added tokens
//   merges   hash map (left id, right id) → (rank, merged id)
//   pipeline normalizer steps, pre-tokenizer steps, decoder steps (Sequences flattened at load),
//            post-processor prefix/suffix ids
//
// Everything is read-only after load. Per-call scratch space lives in pd_tok_work (encode).
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "base/buf.h"
#include "base/map.h"
#include "tok/tok.h"

// ---- string → int32 hash map ---------------------------------------------------------------
// A pd_map (base/map.h) whose entries are values only: the key of value v is
// (pool + key_off[v], key_len[v]), arrays owned by the map's user and passed to every call (the
// pool may move as it grows). Hashed with XXH3.
typedef struct pd_tok_smap {
    pd_map map;  // of int32_t; zero (cap 0) until the first put
} pd_tok_smap;

uint64_t pd_tok_hash(const char *s, size_t n);
// Value for key, or -1.
int32_t pd_tok_smap_get(const pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                        const uint32_t *key_len, const char *key, size_t key_len_q);
// Inserts value v (its key must already be in the arrays). Keeps the old value if the key is
// present. PD_ERR_NOMEM on failure.
pd_status pd_tok_smap_put(pd_tok_smap *m, const char *pool, const uint32_t *key_off,
                          const uint32_t *key_len, int32_t v);
void pd_tok_smap_fini(pd_tok_smap *m);

// ---- (id, id) → (rank, id) hash map --------------------------------------------------------
// A pd_map keyed by (left << 32) | right.
typedef struct pd_tok_pmap {
    pd_map map;  // of pd_tok_pmap_entry; zero (cap 0) until the first put
} pd_tok_pmap;

// true and *rank/*id set when the pair merges.
bool pd_tok_pmap_get(const pd_tok_pmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id);
// First insertion of a pair wins (HF keeps the first rank). PD_ERR_NOMEM on failure.
pd_status pd_tok_pmap_put(pd_tok_pmap *m, int32_t a, int32_t b, int32_t rank, int32_t id);
void pd_tok_pmap_fini(pd_tok_pmap *m);

// ---- UTF-8 ----------------------------------------------------------------------------------
// Length of the valid UTF-8 sequence at s[0..n) (1..4), or 0 if it is invalid or truncated.
int pd_tok_utf8_len(const unsigned char *s, size_t n);
bool pd_tok_utf8_valid(const char *s, size_t n);
// Decodes one valid sequence (as checked by pd_tok_utf8_len). *cp = code point; returns length.
int pd_tok_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);
int pd_tok_utf8_encode(uint32_t cp, char out[4]);
// Rust's from_utf8_lossy: the length of the maximal invalid prefix at s (1..3) — replaced by one
// U+FFFD — given that pd_tok_utf8_len(s) == 0. With more_may_come, returns 0 when s[0..n) is
// a truncated but still possibly valid sequence (wait for more bytes).
int pd_tok_utf8_invalid_len(const unsigned char *s, size_t n, bool more_may_come);
// HF ByteFallback's test for a "<0xNN>" token; *out = the byte.
bool pd_tok_byte_token(const char *s, size_t n, uint8_t *out);
// Unicode White_Space.
bool pd_tok_is_space(uint32_t cp);

// ---- tokens -------------------------------------------------------------------------------------
enum {
    PD_TOK_TF_MODEL = 1,    // in the model vocabulary
    PD_TOK_TF_ADDED = 2,    // an added token
    PD_TOK_TF_SPECIAL = 4,  // its string is a special added token's content
};

typedef struct pd_tok_token {
    uint32_t str_off, str_len;      // vocabulary string (model vocab or added content)
    uint32_t bytes_off, bytes_len;  // raw bytes it stands for
    uint8_t flags;                  // 0 = no token has this id
} pd_tok_token;

typedef struct pd_tok_added {
    int32_t id;
    uint32_t off, len;            // content in pool
    uint32_t norm_off, norm_len;  // normalized content (normalized tokens only)
    bool special, lstrip, rstrip, single_word, normalized;
} pd_tok_added;

// A byte trie over added-token contents, for leftmost-longest matching.
typedef struct pd_tok_trie_node {
    int32_t child;    // first child node, -1 none
    int32_t sibling;  // next sibling node, -1 none
    int32_t term;     // index into pd_tok.added when a token ends here, else -1
    uint8_t byte;
} pd_tok_trie_node;

typedef struct pd_tok_trie {
    pd_tok_trie_node *nodes;  // nodes[0] is the root
    int n;
    size_t cap;
    bool first_byte[256];
} pd_tok_trie;

// ---- pipeline steps -----------------------------------------------------------------------------
typedef enum pd_tok_norm_kind {
    PD_TOK_NORM_PREPEND,
    PD_TOK_NORM_REPLACE,  // literal pattern (re == NULL) or regex
    PD_TOK_NORM_NFC,
    PD_TOK_NORM_STRIP,
} pd_tok_norm_kind;

typedef struct pd_tok_norm {
    pd_tok_norm_kind kind;
    uint32_t a_off, a_len;  // Prepend: prepend; Replace: pattern
    uint32_t b_off, b_len;  // Replace: content
    pcre2_code *re;         // owned; Replace with a Regex pattern
    bool left, right;       // Strip
} pd_tok_norm;

typedef enum pd_tok_split_behavior {
    PD_TOK_SPLIT_REMOVED,
    PD_TOK_SPLIT_ISOLATED,
    PD_TOK_SPLIT_MERGED_PREV,
    PD_TOK_SPLIT_MERGED_NEXT,
    PD_TOK_SPLIT_CONTIGUOUS,
} pd_tok_split_behavior;

typedef enum pd_tok_pre_kind {
    PD_TOK_PRE_SPLIT,      // regex or literal split
    PD_TOK_PRE_BYTELEVEL,  // optional GPT-2 regex split, then bytes → unicode chars
    PD_TOK_PRE_METASPACE,
} pd_tok_pre_kind;

typedef enum pd_tok_prepend { PD_TOK_PREPEND_ALWAYS, PD_TOK_PREPEND_FIRST, PD_TOK_PREPEND_NEVER } pd_tok_prepend;

typedef struct pd_tok_pre {
    pd_tok_pre_kind kind;
    pcre2_code *re;  // owned; Split (and ByteLevel with use_regex)
    pd_tok_split_behavior behavior;
    bool invert;
    bool add_prefix_space;     // ByteLevel
    uint32_t rep_off, rep_len;  // Metaspace replacement (UTF-8)
    pd_tok_prepend prepend;    // Metaspace
    bool split;                // Metaspace
} pd_tok_pre;

typedef enum pd_tok_dec_kind {
    PD_TOK_DEC_BYTELEVEL,
    PD_TOK_DEC_REPLACE,
    PD_TOK_DEC_BYTEFALLBACK,
    PD_TOK_DEC_FUSE,
    PD_TOK_DEC_STRIP,
    PD_TOK_DEC_METASPACE,
} pd_tok_dec_kind;

typedef struct pd_tok_dec {
    pd_tok_dec_kind kind;
    uint32_t a_off, a_len;  // Replace: pattern; Strip: content char; Metaspace: replacement
    uint32_t b_off, b_len;  // Replace: content
    int start, stop;        // Strip
    bool strip_first;       // Metaspace: prepend_scheme != never
} pd_tok_dec;

#define PD_TOK_MAX_STEPS 16

struct pd_tok {
    char *pool;  // owned
    size_t pool_len, pool_cap;

    pd_tok_token *tokens;  // owned, n_vocab entries
    int n_vocab;
    uint32_t *str_off, *str_len;  // owned, n_vocab: model-vocabulary strings, the keys of `vocab`

    pd_tok_smap vocab;  // model vocabulary string → id
    pd_tok_smap added_map;  // added content → id
    pd_tok_pmap merges;

    // BPE model
    int32_t unk_id;  // -1 none
    bool fuse_unk, byte_fallback, ignore_merges;
    int32_t byte_ids[256];  // <0xNN> token ids (-1 when absent)

    // added tokens
    pd_tok_added *added;  // owned
    int n_added;
    uint32_t *added_key_off, *added_key_len;  // owned, per id (for added_map)
    pd_tok_trie trie_raw, trie_norm;

    pd_tok_norm norms[PD_TOK_MAX_STEPS];
    int n_norms;
    pd_tok_pre pres[PD_TOK_MAX_STEPS];
    int n_pres;
    pd_tok_dec decs[PD_TOK_MAX_STEPS];
    int n_decs;
    bool has_decoder;
    int dec_fuse_idx;  // index of the first Fuse/ByteLevel decoder step, n_decs if none

    // post-processor
    bool has_post;
    int32_t prefix_ids[8], suffix_ids[8];
    int n_prefix, n_suffix;

    // byte-level tables
    char byte_char[256][3];  // UTF-8 of the unicode char for each byte
    uint8_t byte_char_len[256];
    int16_t char_to_byte[324];  // inverse: code point → byte, -1 if not a byte char

    // tokenizer_config.json
    int32_t bos_id, eos_id;
    char *bos_token, *eos_token;  // owned, NULL if none
    char **tmpl_names, **tmpl_texts;  // owned, n_tmpl
    int n_tmpl;
    size_t cap_tmpl_names, cap_tmpl_texts;
    int default_tmpl;  // index, -1 none

    pcre2_general_context *gctx;  // owned; routes PCRE2 allocations through pd_malloc
    pcre2_code *re_word;          // owned; \w for single_word
};

// tok_encode.c: appends the normalizer's output for s[0..n) to out.
pd_status pd_tok_normalize(const pd_tok *t, const char *s, size_t n, pd_buf *out);

// tok_nfc.c: appends the NFC form of s[0..n) (valid UTF-8) to out.
pd_status pd_tok_nfc(const char *s, size_t n, pd_buf *out);
