// NATS nkeys (control/nkey.h): a known key pair, round trips, and every malformed seed refused.
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "control/nkey.h"
#include "test.h"

// RFC 8032's ed25519 test vector 1 (secret 9d61b1...7f60, public d75a98...511a), written in the
// nkeys encoding by Python's standard library (base64.b32encode, binascii.crc_hqx): an
// implementation independent of nkey.c's base32, CRC16 and libcrypto's key derivation.
#define RFC8032_SEED "SUAJ2YNRTXX72WTAXKCEV5ES5QWMIRCJYVUXWMTJDFYDXLADDSXH6YALCA"
#define RFC8032_PUB "UDLVVGABQKYQVN6VJP7NHSLEA45A5YLS6PNKMIZFV4BBU2HXA5IRUVAL"

PD_TEST(nkey_known_vector) {
    char pub[PD_NKEY_PUB_LEN + 1];
    PD_CHECK_EQ(pd_nkey_public_from_seed(RFC8032_SEED, pub, NULL), PD_OK);
    PD_CHECK_STR(pub, RFC8032_PUB);
}

PD_TEST(nkey_generate_roundtrip) {
    char seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1], pub2[PD_NKEY_PUB_LEN + 1], seed0[PD_NKEY_SEED_LEN + 1] = "";
    for (int i = 0; i < 20; i++) {
        PD_CHECK_EQ(pd_nkey_generate(seed, pub, NULL), PD_OK);
        PD_CHECK_EQ((int)strlen(seed), PD_NKEY_SEED_LEN);
        PD_CHECK_EQ((int)strlen(pub), PD_NKEY_PUB_LEN);
        PD_CHECK(!strncmp(seed, "SU", 2) && pub[0] == 'U');
        PD_CHECK(strcmp(seed, seed0) != 0);  // fresh each time
        PD_CHECK_EQ(pd_nkey_public_from_seed(seed, pub2, NULL), PD_OK);
        PD_CHECK_STR(pub2, pub);
        memcpy(seed0, seed, sizeof seed0);
    }
}

PD_TEST(nkey_malformed_seeds_refused) {
    char pub[PD_NKEY_PUB_LEN + 1];
    pd_err err = {0};
    PD_CHECK_EQ(pd_nkey_public_from_seed(NULL, pub, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_nkey_public_from_seed("", pub, &err), PD_ERR_INVALID);
    PD_CHECK_EQ(pd_nkey_public_from_seed(RFC8032_PUB, pub, &err), PD_ERR_INVALID);  // a public key, not a seed
    char s[PD_NKEY_SEED_LEN + 2];
    // every single-character change is caught (the checksum, the alphabet or the prefix)
    for (int i = 0; i < PD_NKEY_SEED_LEN; i++) {
        memcpy(s, RFC8032_SEED, sizeof RFC8032_SEED);
        s[i] = s[i] == 'A' ? 'B' : 'A';
        PD_CHECK_EQ(pd_nkey_public_from_seed(s, pub, &err), PD_ERR_INVALID);
        s[i] = 'a';  // lower case is not the alphabet
        PD_CHECK_EQ(pd_nkey_public_from_seed(s, pub, &err), PD_ERR_INVALID);
    }
    memcpy(s, RFC8032_SEED, sizeof RFC8032_SEED);
    s[PD_NKEY_SEED_LEN - 1] = 0;  // truncated
    PD_CHECK_EQ(pd_nkey_public_from_seed(s, pub, &err), PD_ERR_INVALID);
    PD_CHECK(strstr(err.msg, "58 characters") != NULL);
}

PD_TEST(nkey_seed_files) {
    char dir[] = "/tmp/pd_nkey_XXXXXX";
    PD_CHECK(mkdtemp(dir) != NULL);
    char path[96], seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1];
    snprintf(path, sizeof path, "%s/seed", dir);
    PD_CHECK_EQ(pd_nkey_write_seed_file(path, RFC8032_SEED, NULL), PD_OK);
    struct stat st;
    PD_CHECK_EQ(stat(path, &st), 0);
    PD_CHECK_EQ((int)(st.st_mode & 0777), 0600);
    PD_CHECK_EQ(pd_nkey_write_seed_file(path, RFC8032_SEED, NULL), PD_ERR_IO);  // never overwritten
    PD_CHECK_EQ(pd_nkey_read_seed_file(path, seed, pub, NULL), PD_OK);
    PD_CHECK_STR(seed, RFC8032_SEED);
    PD_CHECK_STR(pub, RFC8032_PUB);
    PD_CHECK_EQ(chmod(path, 0640), 0);
    PD_CHECK_EQ(pd_nkey_read_seed_file(path, seed, pub, NULL), PD_ERR_INVALID);  // group may read it
    unlink(path);
    FILE *f = fopen(path, "w");  // two seeds in one file: refused
    PD_CHECK(f != NULL);
    fprintf(f, "%s\n%s\n", RFC8032_SEED, RFC8032_SEED);
    fclose(f);
    PD_CHECK_EQ(chmod(path, 0600), 0);
    PD_CHECK_EQ(pd_nkey_read_seed_file(path, seed, pub, NULL), PD_ERR_INVALID);
    unlink(path);
    snprintf(path, sizeof path, "%s/none", dir);
    PD_CHECK_EQ(pd_nkey_read_seed_file(path, seed, pub, NULL), PD_ERR_IO);
    rmdir(dir);
}
