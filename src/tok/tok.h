// tok — Hugging Face tokenizer.json tokenizers in C: encode text to token ids, decode ids to text
// (whole or streamed one id at a time), and match stop strings in streamed text.
//
// What is supported (anything else in tokenizer.json fails to load with PD_ERR_UNSUPPORTED and a
// message naming the component):
//   * model: BPE, either byte-level (GPT-2 / Llama 3 / Qwen2: ByteLevel pre-tokenizer, the Split
//     regex of tokenizer.json compiled with PCRE2) or SentencePiece-style (Llama 2 / Mistral:
//     "▁" for spaces, byte_fallback to <0xNN> tokens), with ignore_merges, fuse_unk, unk_token.
//   * normalizers: Sequence, Prepend, Replace, NFC, Strip. pre-tokenizers: Sequence, Split,
//     ByteLevel, Metaspace, Whitespace, WhitespaceSplit. decoders: Sequence, ByteLevel, Metaspace,
//     Replace, ByteFallback, Fuse, Strip. post-processors: TemplateProcessing, ByteLevel,
//     Sequence, RobertaProcessing, BertProcessing (single sequence).
//   * added_tokens: matched before the model, leftmost-longest, honouring special, lstrip, rstrip,
//     single_word and normalized exactly as HF tokenizers' AddedVocabulary does.
// The reference is HF tokenizers (Tokenizer.from_file(...).encode/decode); the golden tests
// compare ids and decoded text byte for byte.
//
// Text in is UTF-8; invalid UTF-8 is rejected (PD_ERR_INVALID). Text out is always valid UTF-8.
//
// Thread safety: a pd_tok is read-only after pd_tok_load, so any number of threads may encode and
// decode with one pd_tok at once. Each encode call keeps its own BPE word cache (no locks, no
// shared mutable state). A pd_tok_stream or pd_tok_stop belongs to one thread at a time.
//
// Ownership: pd_tok owns every string it hands out (valid until pd_tok_free). Streams and stop
// matchers return text that is valid until their next call.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_tok pd_tok;

// A growable id vector owned by the caller. Zero-initialise it; free it with pd_tok_ids_free.
typedef struct pd_tok_ids {
    int32_t *ids;  // owned (pd_malloc)
    int n;
    size_t cap;
} pd_tok_ids;

// Frees v->ids and zeroes *v. NULL is a no-op.
void pd_tok_ids_free(pd_tok_ids *v);
// Appends one id. PD_ERR_NOMEM on allocation failure (v unchanged).
pd_status pd_tok_ids_push(pd_tok_ids *v, int32_t id);

// ---- loading -------------------------------------------------------------------------------

// Loads <model_dir>/tokenizer.json and (optional) <model_dir>/tokenizer_config.json.
// Returns NULL on failure, with err naming the problem:
//   PD_ERR_NOTFOUND     tokenizer.json missing
//   PD_ERR_PROTO        bad JSON or malformed content (line/column or field named)
//   PD_ERR_UNSUPPORTED  a model / normalizer / pre-tokenizer / decoder / post-processor type we
//                       do not implement (the type is named)
//   PD_ERR_NOMEM
// out: owned by caller (free with pd_tok_free).
pd_tok *pd_tok_load(const char *model_dir, pd_err *err);
// NULL is a no-op.
void pd_tok_free(pd_tok *t);

// ---- encode / decode -------------------------------------------------------------------------

// Encodes text[0..len) and APPENDS the ids to out (out->n grows).
//   add_special    add what HF encode(text, add_special_tokens=True) adds (the post-processor's
//                  template, e.g. BOS; without a post-processor: add_bos_token / add_eos_token
//                  from tokenizer_config.json).
//   parse_special  match special added tokens in the text (HF default). false: their text is
//                  ordinary text (HF encode_special_tokens=True). Non-special added tokens are
//                  matched either way.
// Returns PD_OK, PD_ERR_INVALID (text is not valid UTF-8 or longer than PD_TOK_MAX_TEXT_BYTES;
// out unchanged) or PD_ERR_NOMEM (out unchanged).
#define PD_TOK_MAX_TEXT_BYTES ((size_t)1 << 30)
pd_status pd_tok_encode(const pd_tok *t, const char *text, size_t len, bool add_special,
                        bool parse_special, pd_tok_ids *out);

// Decodes ids as HF decode(ids, skip_special_tokens=skip_special) does. Ids that name no token
// are skipped, as HF does. *out: owned by caller (pd_free), NUL-terminated; *out_len excludes
// the NUL. Returns PD_OK or PD_ERR_NOMEM.
pd_status pd_tok_decode(const pd_tok *t, const int32_t *ids, int n, bool skip_special,
                        char **out, size_t *out_len);

// ---- streaming detokenizer -------------------------------------------------------------------
// Feed ids one at a time and get back the text each one completes. The output never ends in the
// middle of a UTF-8 character, and the concatenation of every feed's output plus finish's output
// equals pd_tok_decode() of all the ids fed. Text is held back only while the decoder cannot know
// it yet: an incomplete UTF-8 sequence, a run of <0xNN> byte-fallback tokens (HF decodes a run as
// a whole: an invalid run becomes one U+FFFD per byte) or a Strip decoder's trailing characters.
typedef struct pd_tok_stream pd_tok_stream;

// t: borrowed (must outlive the stream). NULL on allocation failure.
pd_tok_stream *pd_tok_stream_new(const pd_tok *t, bool skip_special);
void pd_tok_stream_free(pd_tok_stream *s);  // NULL is a no-op
// Feeds one id. *text / *len: the newly completed text (may be empty), valid until the next call
// on s. Ids that name no token are skipped. Returns PD_OK or PD_ERR_NOMEM.
pd_status pd_tok_stream_feed(pd_tok_stream *s, int32_t id, const char **text, size_t *len);
// Ends the sequence and returns the text still held back (an unfinished UTF-8 sequence comes out
// as U+FFFD, as HF does). After finish the stream is reset and can start a new sequence.
pd_status pd_tok_stream_finish(pd_tok_stream *s, const char **text, size_t *len);

// ---- stop strings ------------------------------------------------------------------------------
// Watches streamed text for stop strings (OpenAI "stop"). Feed text fragments as they come; each
// call returns the text that is safe to show now. Text that could still be the start of a stop
// string is held back until it is ruled out (then it is released) or the stream ends (finish
// releases it). When a stop string completes, the result reports it and the text before it; the
// stop string itself is not emitted unless include_stop. After a stop, further feeds are ignored.
// When several stop strings complete in one fragment, the one that ends first wins (on a tie,
// the one that starts first). Works on bytes; fed valid UTF-8 it never splits a character.
typedef struct pd_tok_stop pd_tok_stop;

typedef struct pd_tok_stop_result {
    const char *text;  // valid until the next call on the matcher
    size_t len;        // bytes of text safe to emit now
    bool is_stopped;   // a stop string completed (in this call or before)
    int stop_idx;      // index of the stop string that matched, -1 if none
    size_t stop_pos;   // byte offset, in all text fed so far, where the stop string begins
} pd_tok_stop_result;

// stops[i]: n_stops NUL-terminated strings (copied). include_stop: emit the stop string too.
// NULL with err set when a stop string is empty (PD_ERR_INVALID) or on allocation failure.
pd_tok_stop *pd_tok_stop_new(const char *const *stops, int n_stops, bool include_stop,
                             pd_err *err);
void pd_tok_stop_free(pd_tok_stop *s);  // NULL is a no-op
// Returns PD_OK or PD_ERR_NOMEM. res is always filled.
pd_status pd_tok_stop_feed(pd_tok_stop *s, const char *text, size_t len, pd_tok_stop_result *res);
// No more text: releases what was held back (nothing if a stop string already matched).
pd_status pd_tok_stop_finish(pd_tok_stop *s, pd_tok_stop_result *res);

// ---- accessors -------------------------------------------------------------------------------

// Largest token id + 1 (model vocabulary and added tokens).
int pd_tok_n_vocab(const pd_tok *t);
// BOS / EOS ids from tokenizer_config.json (bos_token, eos_token), else BOS from the
// post-processor template; -1 if none.
int32_t pd_tok_bos_id(const pd_tok *t);
int32_t pd_tok_eos_id(const pd_tok *t);
// BOS / EOS token strings (tokenizer_config.json or the ids' tokens); NULL if none.
const char *pd_tok_bos_token(const pd_tok *t);
const char *pd_tok_eos_token(const pd_tok *t);
// Whether encode(add_special=true) starts with the BOS id (so a chat template that writes BOS
// itself should be encoded with add_special=false).
bool pd_tok_adds_bos(const pd_tok *t);
// Id of a token given as its vocabulary string (added tokens first, then the model vocabulary,
// as HF token_to_id); -1 if none. s need not be NUL-terminated.
int32_t pd_tok_token_to_id(const pd_tok *t, const char *s, size_t len);
// The token's string as written in tokenizer.json ("Ġthe", "▁the", "<0x0A>"); NULL if id names
// no token.
const char *pd_tok_token_str(const pd_tok *t, int32_t id);
// The raw bytes the token stands for (" the", "\n"); NULL if id names no token. For byte-level
// vocabularies these may be part of a UTF-8 character. *len: byte count (may contain NUL).
const char *pd_tok_token_bytes(const pd_tok *t, int32_t id, size_t *len);
// Whether id is a special token (skipped by decode with skip_special).
bool pd_tok_is_special(const pd_tok *t, int32_t id);
// The chat template of tokenizer_config.json: the string, or the "default" entry of a list of
// {name, template}. NULL if none.
const char *pd_tok_chat_template(const pd_tok *t);
// A named template from the list form ("tool_use", ...); NULL if none.
const char *pd_tok_chat_template_named(const pd_tok *t, const char *name);

#ifdef __cplusplus
}
#endif
