// Replays a fuzz target's committed corpus (tests/fuzz/corpus/<target>/) without libFuzzer, so
// `make test` re-checks every input that ever found a bug or new coverage. Linked with one
// fuzz_<target>.c; the target name comes from PD_FUZZ_TARGET (set by the Makefile).
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
// Optional, as in libFuzzer: one-time set-up (loading a tokenizer, a template).
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));
#define STR2(x) #x
#define STR(x) STR2(x)

int main(int argc, char **argv) {
    const char *repo = getenv("PD_REPO_DIR");
    char dir[1024];
    if (argc > 1) snprintf(dir, sizeof dir, "%s", argv[1]);
    else snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/%s", repo ? repo : ".", STR(PD_FUZZ_TARGET));
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    DIR *d = opendir(dir);
    if (!d) {
        printf("no corpus at %s\n0 passed, 1 failed\n", dir);
        return 1;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
        if (fread(buf, 1, (size_t)len, f) != (size_t)len) len = 0;
        fclose(f);
        LLVMFuzzerTestOneInput(buf, (size_t)len);  // a crash or sanitizer report fails the test
        free(buf);
        n++;
    }
    closedir(d);
    printf("replayed %d inputs of %s\n%d passed, 0 failed\n", n, STR(PD_FUZZ_TARGET), n);
    return 0;
}
