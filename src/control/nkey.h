// control/nkey — NATS nkeys (ed25519 key pairs in the nkeys text encoding) for the control plane's
// NATS authentication (`pdserve nkey-gen`, `--control-nkey-seed FILE`).
//
// Encoding (the nkeys spec, as nats-server and every NATS client read it): bytes = prefix ||
// key || CRC16 (XMODEM: polynomial 0x1021, initial 0, no reflection; appended little-endian),
// then RFC 4648 base32 without padding. A user public key has the 1-byte prefix 20 << 3 ('U...',
// 35 bytes → 56 characters); a user seed has the 2-byte prefix (18 << 3 | USER >> 5,
// (USER & 31) << 3) ('SU...', 36 bytes → 58 characters) over the 32-byte ed25519 seed. The key
// pair comes from OpenSSL's libcrypto (EVP_PKEY_ED25519); the seed never leaves the file it is
// written to (mode 0600), and nats-server only ever sees the public key and signatures.
#pragma once

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_NKEY_SEED_LEN 58
#define PD_NKEY_PUB_LEN 56
#define PD_NKEY_SIG_LEN 64

// A fresh user key pair. PD_OK, or PD_ERR_IO (libcrypto failed) with err.
pd_status pd_nkey_generate(char seed[PD_NKEY_SEED_LEN + 1], char pub[PD_NKEY_PUB_LEN + 1], pd_err *err);
// The public key of a user seed ("SU..."): PD_ERR_INVALID (with err naming what is wrong: length,
// alphabet, checksum, not a user seed) or PD_OK.
pd_status pd_nkey_public_from_seed(const char *seed, char pub[PD_NKEY_PUB_LEN + 1], pd_err *err);
// The ed25519 signature (RFC 8032: deterministic, 64 bytes) of msg's n bytes with the user seed's
// key, as nats-server verifies the signed nonce. PD_ERR_INVALID (a malformed seed) or PD_ERR_IO
// (libcrypto failed), with err.
pd_status pd_nkey_sign(const char *seed, const void *msg, size_t n, uint8_t sig[PD_NKEY_SIG_LEN], pd_err *err);
// Reads a seed file (its one line: the seed; surrounding whitespace ignored). Refuses a file group
// or others may read, anything but exactly one user seed, and then derives the public key.
pd_status pd_nkey_read_seed_file(const char *path, char seed[PD_NKEY_SEED_LEN + 1], char pub[PD_NKEY_PUB_LEN + 1],
                                 pd_err *err);
// Writes seed + "\n" to path with mode 0600 (O_EXCL: never overwrites).
pd_status pd_nkey_write_seed_file(const char *path, const char *seed, pd_err *err);

#ifdef __cplusplus
}
#endif
