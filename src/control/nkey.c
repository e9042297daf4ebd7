// nkey.c — NATS nkeys: generation, the text encoding and seed files (see nkey.h).
#include "control/nkey.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PREFIX_SEED (18u << 3)
#define PREFIX_USER (20u << 3)

static const char B32[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

static uint16_t crc16(const uint8_t *p, size_t n) {
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++) crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

// base32 (RFC 4648, no padding) of n bytes into out (ceil(8n/5) chars + NUL).
static void b32_encode(const uint8_t *p, size_t n, char *out) {
    uint32_t acc = 0;
    int bits = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        acc = (acc << 8) | p[i];
        bits += 8;
        while (bits >= 5) {
            out[k++] = B32[(acc >> (bits - 5)) & 31];
            bits -= 5;
        }
    }
    if (bits > 0) out[k++] = B32[(acc << (5 - bits)) & 31];
    out[k] = 0;
}

// Decodes exactly n_chars characters into out (cap bytes); the number of bytes, or -1 on a
// character outside the alphabet or non-zero trailing bits.
static int b32_decode(const char *s, size_t n_chars, uint8_t *out, size_t cap) {
    uint32_t acc = 0;
    int bits = 0;
    size_t k = 0;
    for (size_t i = 0; i < n_chars; i++) {
        const char *q = s[i] ? strchr(B32, s[i]) : NULL;
        if (!q) return -1;
        acc = (acc << 5) | (uint32_t)(q - B32);
        bits += 5;
        if (bits >= 8) {
            if (k >= cap) return -1;
            out[k++] = (uint8_t)(acc >> (bits - 8));
            bits -= 8;
        }
    }
    if (bits > 0 && (acc & ((1u << bits) - 1))) return -1;
    return (int)k;
}

static void encode_pub(const uint8_t key[32], char pub[PD_NKEY_PUB_LEN + 1]) {
    uint8_t raw[35];
    raw[0] = PREFIX_USER;
    memcpy(raw + 1, key, 32);
    uint16_t c = crc16(raw, 33);
    raw[33] = (uint8_t)c;
    raw[34] = (uint8_t)(c >> 8);
    b32_encode(raw, sizeof raw, pub);
}

static pd_status pub_of(const uint8_t sk[32], char pub[PD_NKEY_PUB_LEN + 1], pd_err *err) {
    EVP_PKEY *k = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, sk, 32);
    uint8_t pk[32];
    size_t n = sizeof pk;
    bool ok = k && EVP_PKEY_get_raw_public_key(k, pk, &n) == 1 && n == 32;
    EVP_PKEY_free(k);
    if (!ok) return pd_err_set(err, PD_ERR_IO, "nkey: libcrypto cannot derive the ed25519 public key");
    encode_pub(pk, pub);
    OPENSSL_cleanse(pk, sizeof pk);
    return PD_OK;
}

pd_status pd_nkey_generate(char seed[PD_NKEY_SEED_LEN + 1], char pub[PD_NKEY_PUB_LEN + 1], pd_err *err) {
    uint8_t raw[36];
    raw[0] = (uint8_t)(PREFIX_SEED | (PREFIX_USER >> 5));
    raw[1] = (uint8_t)((PREFIX_USER & 31) << 3);
    if (RAND_bytes(raw + 2, 32) != 1) return pd_err_set(err, PD_ERR_IO, "nkey: no randomness from libcrypto");
    pd_status st = pub_of(raw + 2, pub, err);
    if (st == PD_OK) {
        uint16_t c = crc16(raw, 34);
        raw[34] = (uint8_t)c;
        raw[35] = (uint8_t)(c >> 8);
        b32_encode(raw, sizeof raw, seed);
    }
    OPENSSL_cleanse(raw, sizeof raw);
    return st;
}

// The seed's 36 bytes (prefix, the 32-byte ed25519 seed at raw + 2, CRC), checked.
static pd_status decode_seed(const char *seed, uint8_t raw[40], pd_err *err) {
    if (!seed || strlen(seed) != PD_NKEY_SEED_LEN)
        return pd_err_set(err, PD_ERR_INVALID, "nkey: a user seed is %d characters (got %zu)", PD_NKEY_SEED_LEN,
                          seed ? strlen(seed) : (size_t)0);
    int n = b32_decode(seed, PD_NKEY_SEED_LEN, raw, 40);
    if (n != 36) return pd_err_set(err, PD_ERR_INVALID, "nkey: the seed is not base32 (A-Z, 2-7)");
    if (crc16(raw, 34) != (uint16_t)(raw[34] | raw[35] << 8))
        return pd_err_set(err, PD_ERR_INVALID, "nkey: the seed's checksum does not match (a typo or a truncated file?)");
    if ((raw[0] & 0xf8) != PREFIX_SEED || (((unsigned)raw[0] & 7) << 5 | ((unsigned)raw[1] & 0xf8) >> 3) != PREFIX_USER)
        return pd_err_set(err, PD_ERR_INVALID, "nkey: not a user seed (it must start with SU)");
    return PD_OK;
}

pd_status pd_nkey_public_from_seed(const char *seed, char pub[PD_NKEY_PUB_LEN + 1], pd_err *err) {
    uint8_t raw[40];
    pd_status st = decode_seed(seed, raw, err);
    if (st == PD_OK) st = pub_of(raw + 2, pub, err);
    OPENSSL_cleanse(raw, sizeof raw);
    return st;
}

pd_status pd_nkey_sign(const char *seed, const void *msg, size_t n, uint8_t sig[PD_NKEY_SIG_LEN], pd_err *err) {
    uint8_t raw[40];
    pd_status st = decode_seed(seed, raw, err);
    if (st != PD_OK) {
        OPENSSL_cleanse(raw, sizeof raw);
        return st;
    }
    EVP_PKEY *k = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, raw + 2, 32);
    OPENSSL_cleanse(raw, sizeof raw);
    EVP_MD_CTX *md = k ? EVP_MD_CTX_new() : NULL;
    size_t len = PD_NKEY_SIG_LEN;
    // ed25519 (RFC 8032, pure): no digest of its own; one-shot over the whole message
    bool ok = md && EVP_DigestSignInit(md, NULL, NULL, NULL, k) == 1 &&
              EVP_DigestSign(md, sig, &len, (const unsigned char *)msg, n) == 1 && len == PD_NKEY_SIG_LEN;
    EVP_MD_CTX_free(md);
    EVP_PKEY_free(k);
    if (!ok) return pd_err_set(err, PD_ERR_IO, "nkey: libcrypto cannot sign with the ed25519 key");
    return PD_OK;
}

pd_status pd_nkey_read_seed_file(const char *path, char seed[PD_NKEY_SEED_LEN + 1], char pub[PD_NKEY_PUB_LEN + 1],
                                 pd_err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_err_set(err, PD_ERR_IO, "nkey seed %s: %s", path, strerror(errno));
    struct stat sb;
    char buf[256];
    ssize_t n = -1;
    pd_status st = PD_OK;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        st = pd_err_set(err, PD_ERR_INVALID, "nkey seed %s: not a regular file", path);
    } else if (sb.st_mode & 077) {
        st = pd_err_set(err, PD_ERR_INVALID, "nkey seed %s: readable by group or others (chmod 600)", path);
    } else if ((n = read(fd, buf, sizeof buf - 1)) < 0) {
        st = pd_err_set(err, PD_ERR_IO, "nkey seed %s: %s", path, strerror(errno));
    }
    close(fd);
    if (st != PD_OK || n < 0) return st;
    buf[n] = 0;
    size_t a = 0, b = (size_t)n;
    while (a < b && strchr(" \t\r\n", buf[a])) a++;
    while (b > a && strchr(" \t\r\n", buf[b - 1])) b--;
    if (b - a != PD_NKEY_SEED_LEN || (size_t)n == sizeof buf - 1) {
        st = pd_err_set(err, PD_ERR_INVALID, "nkey seed %s: expected one %d-character user seed (pdserve nkey-gen)", path,
                        PD_NKEY_SEED_LEN);
    } else {
        memcpy(seed, buf + a, PD_NKEY_SEED_LEN);
        seed[PD_NKEY_SEED_LEN] = 0;
        st = pd_nkey_public_from_seed(seed, pub, err);
    }
    OPENSSL_cleanse(buf, sizeof buf);
    if (st != PD_OK) OPENSSL_cleanse(seed, PD_NKEY_SEED_LEN + 1);
    return st;
}

pd_status pd_nkey_write_seed_file(const char *path, const char *seed, pd_err *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return pd_err_set(err, PD_ERR_IO, "nkey seed %s: %s", path, strerror(errno));
    char line[PD_NKEY_SEED_LEN + 2];
    int n = snprintf(line, sizeof line, "%s\n", seed);
    bool ok = n == PD_NKEY_SEED_LEN + 1 && write(fd, line, (size_t)n) == n;
    OPENSSL_cleanse(line, sizeof line);
    if (close(fd) || !ok) {
        unlink(path);
        return pd_err_set(err, PD_ERR_IO, "nkey seed %s: write failed", path);
    }
    return PD_OK;
}
