// grammar — constrained decoding: a context-free grammar over bytes, a pushdown recognizer, and
// the per-step token mask over a tokenizer's vocabulary (which tokens may come next).
//
//   GBNF text ──pd_grammar_new──► pd_grammar (rules over byte classes; immutable but for caches)
//   JSON schema ──pd_grammar_schema_to_gbnf──► GBNF text (OpenAI strict-mode subset)
//   pd_grammar + end ids ──pd_grammar_matcher_new──► matcher: fill_mask / accept, one per sequence
//
// Grammar language (GBNF, llama.cpp's syntax): `name ::= alternatives`, `|`, sequences, "literals"
// and [character classes] with \n \r \t \\ \" \] \xHH \uHHHH \UHHHHHHHH escapes, [^...] negation,
// `.` (any character), ( groups ), `*` `+` `?` `{m}` `{m,}` `{m,n}`, `# comments`; the start rule
// is `root`. Characters are Unicode code points; the compiler lowers them to UTF-8 byte sequences,
// so the recognizer works on bytes and a token that ends inside a multi-byte character is judged
// by its bytes. Left recursion (direct, indirect or through nullable symbols) is refused.
//
// Recognizer: the state is a set of stacks of grammar positions (llama.cpp's representation),
// hash-consed into a per-matcher arena so equal stacks are one node; repetition rules are tail
// calls, so `x*` does not deepen the stack.
//
// Mask: a trie of the vocabulary's byte strings (special tokens excluded) is walked once per
// grammar position that can be on top of a stack, with a sentinel below it: tokens that some path
// consumes without leaving the position's rule are accepted whatever lies below; tokens that die
// inside it are rejected; only tokens that leave the rule ("uncertain") are checked against the
// real stack at run time (xgrammar's context-independent / context-dependent split). The
// per-position results are cached in the pd_grammar (lazily, under its mutex) and shared by every
// sequence using it. End tokens (EOS, stop ids) are allowed exactly when the grammar is in an
// accepting state.
//
// Threads: a pd_grammar may be shared by any threads (reference counted, caches locked); a matcher
// belongs to one thread at a time.
#pragma once
#include <jansson.h>

#include "base/base.h"
#include "tok/tok.h"

#ifdef __cplusplus
extern "C" {
#endif

// The vocabulary as byte strings in a trie. Built once per tokenizer; immutable.
typedef struct pd_grammar_vocab pd_grammar_vocab;
pd_grammar_vocab *pd_grammar_vocab_new(const pd_tok *tok, pd_err *err);
void pd_grammar_vocab_free(pd_grammar_vocab *v);  // NULL is a no-op; after every grammar using it
int pd_grammar_vocab_size(const pd_grammar_vocab *v);

typedef struct pd_grammar pd_grammar;
// Compiles GBNF text against vocab (borrowed: must outlive the grammar). NULL with err
// (PD_ERR_INVALID: the message says where and why; PD_ERR_NOMEM).
pd_grammar *pd_grammar_new(const char *gbnf, size_t len, const pd_grammar_vocab *vocab, pd_err *err);
pd_grammar *pd_grammar_ref(pd_grammar *g);
void pd_grammar_unref(pd_grammar *g);  // NULL is a no-op
// Number of flat grammar elements (for tests and logs).
int pd_grammar_n_elems(const pd_grammar *g);

// JSON schema (OpenAI strict-mode subset) → GBNF. *out: pd_malloc'd NUL-terminated text.
// Supported: type (string, number, integer, boolean, null, object, array, and arrays of types),
// properties / required / additionalProperties: false (properties in the schema's order; optional
// ones may be left out), items / minItems / maxItems, enum, const, anyOf / oneOf (as anyOf),
// allOf of one schema, $ref to a JSON pointer in the same document ($defs, definitions, ...),
// string minLength / maxLength / format (date, time, date-time, email, uuid), integer minimum /
// maximum / exclusive bounds (a span <= 4096: every value; wider: the whole digit counts inside
// the range, plus 0 and single digits, so every output is in range), nullable. Annotations (title,
// description, default, examples, $schema, $id, strict, $comment) are ignored. Anything else
// that constrains values is PD_ERR_INVALID naming the keyword and its JSON path (a constraint we
// could not enforce is never dropped). Whitespace between tokens is limited (one space, or a
// newline and up to 16 spaces); integer parts have at most 16 digits, fractions 16, exponents 2
// (so every number is a finite double).
pd_status pd_grammar_schema_to_gbnf(const json_t *schema, char **out, pd_err *err);
// The GBNF of any JSON value (an object at the root when object_root): response_format json_object.
const char *pd_grammar_json_gbnf(void);
// Appends the schema's rules to an existing GBNF (rules prefixed by prefix, e.g. "t0-"), whose
// start rule is named "<prefix>root"; for grammars that embed several schemas (tool calls).
pd_status pd_grammar_schema_rules(const json_t *schema, const char *prefix, char **buf, size_t *len,
                                  size_t *cap, pd_err *err);
// Escapes s as the body of a GBNF "literal" into buf (pd_realloc'd).
pd_status pd_grammar_append_literal(const char *s, size_t n, char **buf, size_t *len, size_t *cap);

typedef struct pd_grammar_matcher pd_grammar_matcher;
// end_ids: the tokens that end a sequence (EOS, stop ids): allowed only in an accepting state.
pd_grammar_matcher *pd_grammar_matcher_new(pd_grammar *g, const int32_t *end_ids, int n_end);
void pd_grammar_matcher_free(pd_grammar_matcher *m);  // NULL is a no-op
// Words of a mask: (vocab + 31) / 32; bit t of word t / 32 set = token t allowed.
int pd_grammar_mask_words(const pd_grammar_vocab *v);
// Writes the allowed tokens for the next position. Returns the number allowed (0: the grammar is
// stuck — it cannot happen unless the vocabulary cannot spell what the grammar requires).
int pd_grammar_matcher_fill_mask(pd_grammar_matcher *m, uint32_t *mask);
// Advances by one token. PD_ERR_INVALID if the token is not allowed (state unchanged).
pd_status pd_grammar_matcher_accept(pd_grammar_matcher *m, int32_t token);
// Advances by raw bytes (tests, and prompts that pre-fill part of the answer). PD_ERR_INVALID if
// they do not match (state unchanged).
pd_status pd_grammar_matcher_accept_bytes(pd_grammar_matcher *m, const char *s, size_t n);
// Whether the bytes could be accepted now (state unchanged): the definition the masks implement.
bool pd_grammar_matcher_can_accept_bytes(pd_grammar_matcher *m, const char *s, size_t n);
// The text so far is a complete sentence of the grammar (an end token is allowed).
bool pd_grammar_matcher_is_accepting(const pd_grammar_matcher *m);
// Nothing but an end token can follow (the sentence is complete and cannot grow).
bool pd_grammar_matcher_is_done(const pd_grammar_matcher *m);

#ifdef __cplusplus
}
#endif
