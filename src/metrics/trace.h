// trace — W3C trace context (traceparent) and span export, so that one request can be followed
// across the router, the decode worker and the prefill worker.
//
// Propagation: the router reads a client's `traceparent` header (or starts a trace), opens its
// span and sends `traceparent: 00-<trace id>-<its span id>-01` to the worker; the decode worker
// does the same toward the prefill worker inside PREFILL_REQ (wire/kv.h). Every process exports
// its own spans; they share the trace id and name their parents, so a viewer stitches them.
//
// Export (process-wide; pd_trace_init once at start, before threads use it):
//   --trace-dir DIR  Chrome trace event files, one per process: DIR/pdserve-<service>-<pid>.json,
//                    the "JSON array format" (a '[' then one complete event per line, flushed as
//                    written; the closing ']' is optional in that format, so a killed process
//                    leaves a valid file). Open them in Perfetto (ui.perfetto.dev) or
//                    chrome://tracing. Each span is a complete event ("ph":"X", ts/dur in µs of
//                    wall-clock time, pid = process id) with args trace_id, span_id,
//                    parent_span_id and the span's attributes.
// Timestamps: spans are recorded with the monotonic clock (pd_time_us) and converted to Unix
// time with one offset read at init, so spans of different processes on one host line up.
//
// Thread safety: pd_trace_span may be called from any thread (a mutex serialises the writes).
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_trace_ctx {
    uint8_t trace_id[16];
    uint8_t span_id[8];  // the parent's span id (what a traceparent header names)
    bool is_valid;
} pd_trace_ctx;

#define PD_TRACEPARENT_LEN 55  // "00-" 32 hex "-" 16 hex "-" 2 hex

// Parses a W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex>", version 00; all-zero ids invalid).
// PD_OK or PD_ERR_INVALID (out->is_valid false).
pd_status pd_traceparent_parse(const char *s, pd_trace_ctx *out);
// Writes the traceparent naming span_id as parent (sampled flag set). out: 56 bytes.
void pd_traceparent_format(const uint8_t trace_id[16], const uint8_t span_id[8], char out[PD_TRACEPARENT_LEN + 1]);
// Fresh random ids (never all zero).
void pd_trace_new_span_id(uint8_t out[8]);
void pd_trace_new_trace_id(uint8_t out[16]);
// Lowercase hex of n bytes into out (2n + 1 bytes).
void pd_trace_hex(const uint8_t *b, int n, char *out);

// Opens the exporter. service names the process in the file name and spans ("router",
// "decode", ...). trace_dir NULL = tracing off (every call below is then a cheap no-op).
// PD_OK, or PD_ERR_IO (the file cannot be created; err says which).
pd_status pd_trace_init(const char *service, const char *trace_dir, pd_err *err);
bool pd_trace_enabled(void);
// Exports one finished span: trace_id / span_id / parent_span_id (NULL = root), name, monotonic
// start and end (pd_time_us), and attrs_json: NULL or the text of a JSON object's members without
// braces (`"worker":"http://...","attempts":1`), copied into the span's args.
void pd_trace_span(const uint8_t trace_id[16], const uint8_t span_id[8], const uint8_t *parent_span_id,
                   const char *name, int64_t t_start_us, int64_t t_end_us, const char *attrs_json);
// Flushes and closes the file. Safe without init.
void pd_trace_shutdown(void);

#ifdef __cplusplus
}
#endif
