// auth.c — see auth.h.
#include "xfer/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

pd_status pd_auth_load_file(const char *path, char **out, pd_err *err) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_err_set(err, PD_ERR_IO, "auth token file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return pd_err_set(err, PD_ERR_INVALID, "auth token file %s: not a regular file", path);
    }
    if (st.st_mode & 077) {
        close(fd);
        return pd_err_set(err, PD_ERR_INVALID, "auth token file %s: readable by group or others (chmod 600 it)", path);
    }
    if (st.st_size > PD_AUTH_MAX_LEN + 64) {
        close(fd);
        return pd_err_set(err, PD_ERR_INVALID, "auth token file %s: larger than %d bytes", path, PD_AUTH_MAX_LEN);
    }
    char *s = pd_malloc((size_t)st.st_size + 1);
    if (!s) {
        close(fd);
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    }
    size_t n = 0;
    while (n < (size_t)st.st_size) {
        ssize_t r = read(fd, s + n, (size_t)st.st_size - n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) n--;
    s[n] = 0;
    if (n < PD_AUTH_MIN_LEN || strlen(s) != n) {
        pd_free(s);
        return pd_err_set(err, PD_ERR_INVALID, "auth token file %s: the secret must be %d..%d bytes of text", path,
                          PD_AUTH_MIN_LEN, PD_AUTH_MAX_LEN);
    }
    *out = s;
    return PD_OK;
}

pd_status pd_auth_write_new(const char *path, pd_err *err) {
    uint8_t r[32];
    pd_auth_nonce(r);
    char hex[65];
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", r[i]);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return pd_err_set(err, PD_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    bool ok = write(fd, hex, 64) == 64 && write(fd, "\n", 1) == 1;
    close(fd);
    if (!ok) {
        unlink(path);
        return pd_err_set(err, PD_ERR_IO, "cannot write %s", path);
    }
    return PD_OK;
}

void pd_auth_mac(const char *key, const char *label, const uint8_t *a, const uint8_t *b, uint8_t out[32]) {
    uint8_t msg[64 + 32 + 32];
    size_t ln = strnlen(label, 64);
    memcpy(msg, label, ln);
    memcpy(msg + ln, a, 32);
    memcpy(msg + ln + 32, b, 32);
    unsigned int olen = 32;
    if (!HMAC(EVP_sha256(), key, (int)strlen(key), msg, ln + 64, out, &olen)) memset(out, 0, 32);
}

bool pd_auth_mac_equal(const uint8_t *x, const uint8_t *y) { return CRYPTO_memcmp(x, y, 32) == 0; }

void pd_auth_nonce(uint8_t out[32]) {
    if (RAND_bytes(out, 32) == 1) return;
    size_t n = 0;  // libcrypto's generator failed: the kernel's
    while (n < 32) {
        ssize_t r = getrandom(out + n, 32 - n, 0);
        if (r > 0) n += (size_t)r;
        else PD_ASSERT(errno == EINTR);
    }
}
