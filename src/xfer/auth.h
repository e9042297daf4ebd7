// xfer/auth — the shared secret every KV connection proves before any other message is read.
//
// Challenge–response with HMAC-SHA256 (OpenSSL libcrypto), mutual: the prefill worker sends a
// fresh 32-byte nonce Ns; the decode worker answers with its own nonce Nc and
// HMAC(key, "pdkv3 client" || Ns || Nc); the prefill worker checks it (constant time) and answers
// HMAC(key, "pdkv3 server" || Nc || Ns), which the decode worker checks before it sends its HELLO.
// The secret never crosses the wire; a recorded exchange cannot be replayed (fresh nonces on both
// sides), and a peer that fails gets nothing but a closed socket.
#pragma once
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_AUTH_MIN_LEN 16    // bytes of secret at least
#define PD_AUTH_MAX_LEN 4096

// Reads a secret from path: the file's bytes, trailing whitespace removed. Refuses a file that
// group or others may read, a secret shorter than PD_AUTH_MIN_LEN or longer than PD_AUTH_MAX_LEN.
// *out owned by the caller (pd_free).
pd_status pd_auth_load_file(const char *path, char **out, pd_err *err);
// Writes a fresh random secret (64 hex chars) to path with mode 0600 (O_EXCL: never overwrites).
pd_status pd_auth_write_new(const char *path, pd_err *err);
// out = HMAC-SHA256(key, label || a || b), a and b nonce-sized (32 bytes).
void pd_auth_mac(const char *key, const char *label, const uint8_t *a, const uint8_t *b, uint8_t out[32]);
bool pd_auth_mac_equal(const uint8_t *x, const uint8_t *y);  // constant time, 32 bytes
void pd_auth_nonce(uint8_t out[32]);

#ifdef __cplusplus
}
#endif
