// test.h — header-only test harness. Each tests/**/test_*.c file is one binary: it defines
// tests with PD_TEST(name) and includes this header once; main() runs them all (or those whose
// name contains argv[1]) and prints one line per test and a summary. After every test the
// harness checks that pd_malloc'ed memory went back to where it was (a leak is a failure).
//
// Environment: PD_MODELS_DIR (default ../shared/models relative to the repo root) locates the
// golden models; PD_REPO_DIR the repository root (set by tools/run_tests.sh).
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

typedef void (*pd_test_fn)(void);
static struct { const char *name; pd_test_fn fn; } pd_tests_[512];
static int pd_n_tests_, pd_test_failed_, pd_test_skipped_, pd_n_checks_;

#define PD_TEST(tname)                                                  \
    static void tname(void);                                            \
    __attribute__((constructor)) static void pd_reg_##tname(void) {     \
        pd_tests_[pd_n_tests_].name = #tname;                           \
        pd_tests_[pd_n_tests_++].fn = tname;                            \
    }                                                                   \
    static void tname(void)

#define PD_FAIL_(...)                                                   \
    do {                                                                \
        fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);               \
        fprintf(stderr, __VA_ARGS__);                                   \
        fprintf(stderr, "\n");                                          \
        pd_test_failed_ = 1;                                            \
    } while (0)

#define PD_CHECK(c) do { pd_n_checks_++; if (!(c)) PD_FAIL_("check failed: %s", #c); } while (0)
#define PD_CHECK_MSG(c, ...) do { pd_n_checks_++; if (!(c)) PD_FAIL_(__VA_ARGS__); } while (0)
#define PD_CHECK_EQ(a, b)                                                               \
    do {                                                                                \
        long long a_ = (long long)(a), b_ = (long long)(b);                             \
        pd_n_checks_++;                                                                 \
        if (a_ != b_) PD_FAIL_("%s == %s failed: %lld != %lld", #a, #b, a_, b_);        \
    } while (0)
#define PD_CHECK_STR(a, b)                                                              \
    do {                                                                                \
        const char *a_ = (a), *b_ = (b);                                                \
        pd_n_checks_++;                                                                 \
        if (!a_ || !b_ || strcmp(a_, b_))                                               \
            PD_FAIL_("%s == %s failed: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)",   \
                     b_ ? b_ : "(null)");                                               \
    } while (0)
#define PD_CHECK_NEAR(a, b, tol)                                                        \
    do {                                                                                \
        double a_ = (double)(a), b_ = (double)(b);                                      \
        pd_n_checks_++;                                                                 \
        if (!(fabs(a_ - b_) <= (tol))) PD_FAIL_("%s ~ %s failed: %g vs %g (tol %g)", #a, #b, a_, b_, (double)(tol)); \
    } while (0)
#define PD_CHECK_CONTAINS(hay, needle)                                                  \
    do {                                                                                \
        const char *h_ = (hay), *n_ = (needle);                                         \
        pd_n_checks_++;                                                                 \
        if (!h_ || !strstr(h_, n_)) PD_FAIL_("\"%s\" does not contain \"%s\"", h_ ? h_ : "(null)", n_); \
    } while (0)
// Marks the current test skipped (it cannot run here, e.g. no CUDA device) and returns from it.
// A binary in which some test was skipped and none failed exits 77 (the automake convention),
// which tools/run_tests.sh counts as skipped, not passed.
#define PD_SKIP(...)                                                    \
    do {                                                                \
        printf("  skipped: ");                                          \
        printf(__VA_ARGS__);                                            \
        printf("\n");                                                   \
        pd_test_skipped_ = 1;                                           \
        return;                                                         \
    } while (0)
// Stops the current test (after a failure that makes the rest meaningless).
#define PD_REQUIRE(c) do { pd_n_checks_++; if (!(c)) { PD_FAIL_("required: %s", #c); return; } } while (0)

// Path helpers for golden data. Returned strings are static buffers (one per call site slot).
static inline const char *pd_test_models_dir(void) {
    const char *d = getenv("PD_MODELS_DIR");
    return d && *d ? d : "../shared/models";
}
static inline const char *pd_test_path(char *buf, size_t n, const char *rel) {
    snprintf(buf, n, "%s/%s", pd_test_models_dir(), rel);
    return buf;
}
// A deadline `seconds` from now, for bounding waits (never for judging speed). PD_TEST_TIME_SCALE
// (default 1) stretches every deadline: the sanitizer tiers run 5-20x slower.
static inline int64_t pd_test_deadline_us(double seconds) {
    const char *s = getenv("PD_TEST_TIME_SCALE");
    double k = s && atof(s) > 0 ? atof(s) : 1.0;
    return pd_time_us() + (int64_t)(seconds * k * 1e6);
}
static inline const char *pd_test_repo_dir(void) {
    const char *d = getenv("PD_REPO_DIR");
    return d && *d ? d : ".";
}

int main(int argc, char **argv) {
    pd_log_set_level(getenv("PD_TEST_LOG") ? PD_LOG_DEBUG : PD_LOG_WARN);
    int n_pass = 0, n_fail = 0, n_skip = 0;
    for (int i = 0; i < pd_n_tests_; i++) {
        if (argc > 1 && !strstr(pd_tests_[i].name, argv[1])) continue;
        pd_test_failed_ = 0;
        pd_test_skipped_ = 0;
        size_t allocs0 = pd_mem_n_allocs(), used0 = pd_mem_used();
        pd_tests_[i].fn();
        if (pd_mem_n_allocs() != allocs0) {
            PD_FAIL_("leak: %zu allocations (%zu bytes) not freed",
                     pd_mem_n_allocs() - allocs0, pd_mem_used() - used0);
        }
        const char *verdict = pd_test_failed_ ? "FAIL" : pd_test_skipped_ ? "skip" : "ok  ";
        printf("%s %s\n", verdict, pd_tests_[i].name);
        fflush(stdout);
        if (pd_test_failed_) n_fail++;
        else if (pd_test_skipped_) n_skip++;
        else n_pass++;
    }
    printf("%d passed, %d failed, %d skipped (%d checks)\n", n_pass, n_fail, n_skip, pd_n_checks_);
    return n_fail ? 1 : n_skip ? 77 : 0;
}
