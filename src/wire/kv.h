// wire/kv — the binary KV-handoff protocol between a decode worker and a prefill worker
// (docs/kv-wire-format.md). Encode/decode only: bytes in, structs out; no I/O.
//
// Every message is one frame, little-endian:
//
//   offset  size  field
//   0       4     magic "PDKV" (0x564B4450)
//   4       2     version (PD_KVW_VERSION)
//   6       2     type (pd_kvw_type)
//   8       4     body_len      (<= PD_KVW_MAX_BODY)
//   12      4     body_crc      XXH32 of the body: control fields are verified too
//   16      8     payload_len   (<= PD_KVW_MAX_PAYLOAD; KV_SLAB only, else 0)
//   24      ...   body (type-specific fields, below), then payload
//
// The decoder never trusts a length: counts are checked against the body before any array is
// read, and a frame that is short returns PD_AGAIN (read more), never a partial struct.
#pragma once
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_KVW_MAGIC 0x564B4450u
#define PD_KVW_VERSION 4  // 4: KV_NCCL announces one layer (layer-wise nccl transport), PREFILL_FAIL code
                          // 3: HMAC authentication first, per-type frame caps, PREFILL_DONE n_draws
                          // 2: the nccl transport (HELLO carries an NCCL unique id; KV_NCCL)
#define PD_KVW_HDR 24
#define PD_KVW_MAX_BODY (16u << 20)
#define PD_KVW_MAX_PAYLOAD (1ull << 34)
#define PD_KVW_MAX_LAYERS 512
#define PD_KVW_MAX_TOP 20

typedef enum pd_kvw_type {
    PD_KVW_HELLO = 1,         // decode → prefill: fingerprint + how to reach the decode KV pool
    PD_KVW_HELLO_ACK = 2,     // prefill → decode: accepted (or error text)
    PD_KVW_PREFILL_REQ = 3,   // decode → prefill: compute this prompt, send KV for [start, n)
    PD_KVW_KV_SLAB = 4,       // prefill → decode (tcp transport): one layer's K/V rows
    PD_KVW_PREFILL_DONE = 5,  // prefill → decode: first token + per-layer checksums
    PD_KVW_PREFILL_FAIL = 6,  // prefill → decode: could not prefill (reason)
    PD_KVW_PING = 7,
    PD_KVW_PONG = 8,
    PD_KVW_CANCEL = 9,        // decode → prefill: the request went away
    PD_KVW_KV_NCCL = 10,      // prefill → decode (nccl transport): a slab follows on the communicator
    PD_KVW_AUTH_CHALLENGE = 11,  // prefill → decode, first frame: the server's nonce
    PD_KVW_AUTH_PROOF = 12,      // decode → prefill: client nonce + HMAC proof of the shared secret
    PD_KVW_AUTH_OK = 13,         // prefill → decode: the server's HMAC proof (mutual authentication)
    PD_KVW_PROBE = 14,           // decode → prefill: link probe, "send me `bytes` bytes" (≤ PD_KVW_PROBE_MAX)
    PD_KVW_PROBE_DATA = 15,      // prefill → decode: the probe's answer: nonce, bytes, then that many filler bytes
} pd_kvw_type;

#define PD_KVW_PROBE_MAX (4u << 20)
#define PD_KVW_NONCE 32  // bytes of an auth nonce
#define PD_KVW_MAC 32    // HMAC-SHA256

typedef enum pd_kvw_transport {
    PD_KVW_TRANSPORT_TCP = 1,       // KV bytes inline in KV_SLAB payloads
    PD_KVW_TRANSPORT_SHM = 2,       // prefill writes into the decode pool mapped from /dev/shm
    PD_KVW_TRANSPORT_CUDA_IPC = 3,  // prefill writes into the decode pool through CUDA IPC
    PD_KVW_TRANSPORT_NCCL = 4,      // KV slabs through an NCCL communicator (GPU to GPU, any host)
    PD_KVW_TRANSPORT_UCX = 5,       // prefill puts into the decode pool registered with UCX (HELLO: address + rkey)
} pd_kvw_transport;
const char *pd_kvw_transport_name(pd_kvw_transport t);

// What must match for KV computed by one worker to be valid in another.
typedef struct pd_kvw_fingerprint {
    uint32_t arch, n_layers, n_heads, n_kv_heads, head_dim, hidden, vocab;
    uint32_t kv_dtype;      // pd_dtype of the KV cache
    uint32_t block_size;
    uint64_t weights_hash;  // hash of the config and the weights' metadata (pd_model_fingerprint)
} pd_kvw_fingerprint;
// Empty string if equal, else names the first field that differs (static buffer per thread).
const char *pd_kvw_fingerprint_diff(const pd_kvw_fingerprint *a, const pd_kvw_fingerprint *b);

#define PD_KVW_HANDLE_MAX 1024  // HELLO's handle: a pd_buffer_handle, an NCCL id, or UCX address + rkey

typedef struct pd_kvw_hello {
    pd_kvw_fingerprint fp;
    uint32_t transport;          // pd_kvw_transport
    uint32_t pool_n_blocks;      // decode pool size (direct transports)
    uint8_t handle[PD_KVW_HANDLE_MAX];  // pd_buffer_handle bytes (shm, cuda-ipc), the NCCL unique id (nccl),
                                        // or the UCX worker address + rkey (ucx)
    uint32_t handle_len;
} pd_kvw_hello;

typedef struct pd_kvw_hello_ack {
    uint32_t ok;
    pd_kvw_fingerprint fp;
    char error[256];
} pd_kvw_hello_ack;

typedef struct pd_kvw_sampling {
    float temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty;
    int32_t top_k, n_logprobs;
    uint64_t seed;
    uint32_t has_seed;
} pd_kvw_sampling;

typedef struct pd_kvw_prefill_req {
    uint64_t req_id;
    int32_t start_pos;            // KV wanted for positions [start_pos, n_tokens); multiple of block_size
    int32_t n_tokens;
    const int32_t *tokens;        // (n_tokens) borrowed from the frame
    int32_t n_dst_blocks;         // decode blocks for positions [start_pos, n_tokens) in order
    const int32_t *dst_blocks;    // borrowed (unaligned-safe copies are made by the decoder)
    pd_kvw_sampling sampling;
    char traceparent[56];         // "" or the decode worker's request span (W3C traceparent) for tracing
} pd_kvw_prefill_req;

typedef struct pd_kvw_kv_slab {
    uint64_t req_id;
    int32_t layer;
    int32_t n_blocks;             // blocks covered (the request's dst blocks, in order)
    int32_t n_rows_last;          // rows in the last block (others are full)
    uint64_t row_bytes;
    const uint8_t *payload;       // K rows of every block, then V rows; borrowed
    uint64_t payload_len;
} pd_kvw_kv_slab;

// nccl transport: announces the next slab on the connection's communicator: layer `layer` (of the
// request's n_layers) of the request's blocks, laid out like one layer of a cache of n_blocks
// blocks: (2 [K, V], n_blocks, block_size, row_bytes), block i = the request's i-th destination
// block, rows past n_rows_last in the last block are padding. bytes = 2 * n_blocks * block_size *
// row_bytes; the receiver posts its receive of exactly that many bytes, in announcement order.
// A request's layers come in order 0 .. n_layers-1 (other requests' layers may come between).
typedef struct pd_kvw_kv_nccl {
    uint64_t req_id;
    int32_t layer;
    int32_t n_layers, n_blocks, block_size, n_rows_last;
    uint64_t row_bytes;
    uint64_t bytes;
} pd_kvw_kv_nccl;

typedef struct pd_kvw_prefill_done {
    uint64_t req_id;
    int32_t first_token;
    float logprob;
    int32_t n_top;
    int32_t top_ids[PD_KVW_MAX_TOP];
    float top_logprobs[PD_KVW_MAX_TOP];
    int32_t n_layers;
    uint64_t checksums[PD_KVW_MAX_LAYERS];  // per layer slab (base/checksum.h)
    int32_t n_tokens_computed;              // prompt tokens the prefill worker actually ran
    uint64_t n_draws;                       // the request's sampler draws after the first token
                                            // (the decode side continues the same counter)
    int64_t queue_us, compute_us;           // the prefill worker's own queue and compute time (TTFT breakdown)
} pd_kvw_prefill_done;

// Why a PREFILL_FAIL (its code; the reason text is for people).
typedef enum pd_kvw_fail_code {
    PD_KVW_FAIL_ERROR = 0,         // the request could not be prefilled or exported (any other cause)
    PD_KVW_FAIL_POOL_REFUSED = 1,  // the prefill worker refused this connection's decode pool
} pd_kvw_fail_code;

typedef struct pd_kvw_auth {
    uint8_t nonce[PD_KVW_NONCE];  // CHALLENGE: server nonce; PROOF: client nonce; OK: unused
    uint8_t mac[PD_KVW_MAC];      // PROOF, OK
} pd_kvw_auth;

typedef struct pd_kvw_msg {
    pd_kvw_type type;
    union {
        pd_kvw_auth auth;
        pd_kvw_hello hello;
        pd_kvw_hello_ack hello_ack;
        pd_kvw_prefill_req prefill_req;
        pd_kvw_kv_slab kv_slab;
        pd_kvw_kv_nccl kv_nccl;
        pd_kvw_prefill_done done;
        struct { uint64_t req_id; uint32_t code; char reason[256]; } fail;  // code: pd_kvw_fail_code
        struct { uint64_t nonce; } ping;
        struct { uint64_t req_id; } cancel;
        struct {
            uint64_t nonce;
            uint32_t bytes;
            // PROBE_DATA: the prefill worker's measured step-time model (µs per step, per token;
            // < 0 unknown) and its prefill budget per step, for the decode side's link model
            float step_a_us, step_b_us;
            uint32_t chunk_tokens;
        } probe;  // PROBE and PROBE_DATA (the filler is not kept)
    } u;
    // The decoder copies variable arrays here when the frame's alignment is not suitable; owned by
    // the message, freed by pd_kvw_msg_fini.
    int32_t *owned_i32;
} pd_kvw_msg;

// A growable output buffer.
typedef struct pd_kvw_buf {
    uint8_t *data;  // owned
    size_t len, cap;
    bool oom;
} pd_kvw_buf;
void pd_kvw_buf_fini(pd_kvw_buf *b);
void pd_kvw_buf_reset(pd_kvw_buf *b);

// Appends one encoded frame to out. For KV_SLAB the payload bytes are NOT copied: the frame header
// announces payload_len and the caller sends the payload right after the frame. Returns PD_OK or
// PD_ERR_NOMEM.
pd_status pd_kvw_encode(pd_kvw_buf *out, const pd_kvw_msg *m);

// Decodes one frame from buf[0..len).
//   PD_OK         *consumed = bytes used (header + body + payload); m filled, pointers borrow buf
//   PD_AGAIN      incomplete: *consumed = total bytes the frame needs when known (else 0)
//   PD_ERR_PROTO  bad magic, version, type, length, crc or field values (err says which)
// For KV_SLAB the payload must be in buf too (use pd_kvw_peek_len to size the read).
pd_status pd_kvw_decode(const uint8_t *buf, size_t len, pd_kvw_msg *m, size_t *consumed, pd_err *err);
void pd_kvw_msg_fini(pd_kvw_msg *m);
// Total frame size announced by a header (needs PD_KVW_HDR bytes); 0 if the header is invalid or
// the body exceeds its type's cap (pd_kvw_max_body) or a payload comes with a type that has none.
uint64_t pd_kvw_peek_len(const uint8_t *hdr);
// The message type a valid header announces (0 if invalid).
pd_kvw_type pd_kvw_peek_type(const uint8_t *hdr);
// The protocol's cap on a type's body (bytes); 0 for an unknown type. A receiver refuses a header
// announcing more before reading (or allocating for) the body.
uint32_t pd_kvw_max_body(pd_kvw_type t);
// KV_NCCL geometry check (the decoder applies it): positive sizes, 0 <= layer < n_layers,
// n_rows_last <= block_size, row_bytes a multiple of 8, and bytes exactly one layer's slab size
// (no overflow, <= PD_KVW_MAX_PAYLOAD).
bool pd_kvw_kv_nccl_valid(const pd_kvw_kv_nccl *s);
// One layer's slab size: 2 * n_blocks * block_size * row_bytes.
uint64_t pd_kvw_kv_nccl_layer_bytes(int n_blocks, int block_size, uint64_t row_bytes);
// Where the K and V rows start in a KV_NCCL slab at base: *k = base, *v = base + bytes / 2.
void pd_kvw_kv_nccl_split(const pd_kvw_kv_nccl *s, void *base, void **k, void **v);

#ifdef __cplusplus
}
#endif
