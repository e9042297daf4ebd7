// test_knobs.c — base/knobs: the registry is sorted and unique with sane entries; every kind
// accepts what it should and refuses the rest with the variable named; the environment check stops
// at the first bad value and reports unknown variables of the pdserve families with the nearest
// known name.
#include "test.h"

#include "base/knobs.h"

PD_TEST(registry_sorted_unique_and_sane) {
    size_t n;
    const pd_knob *k = pd_knobs(&n);
    PD_CHECK(n > 50);
    for (size_t i = 0; i < n; i++) {
        PD_CHECK_MSG(!strncmp(k[i].name, "PD_", 3) || !strncmp(k[i].name, "PDSERVE_", 8), "%s", k[i].name);
        PD_CHECK_MSG(k[i].what && *k[i].what, "%s has no description", k[i].name);
        if (i) PD_CHECK_MSG(strcmp(k[i - 1].name, k[i].name) < 0, "%s / %s out of order", k[i - 1].name, k[i].name);
        if (k[i].kind == PD_KNOB_INT || k[i].kind == PD_KNOB_FLOAT) PD_CHECK_MSG(k[i].lo < k[i].hi, "%s range", k[i].name);
        if (k[i].kind == PD_KNOB_CHOICE) PD_CHECK_MSG(k[i].choices && *k[i].choices, "%s choices", k[i].name);
        PD_CHECK(pd_knob_find(k[i].name) == &k[i]);
        PD_CHECK(pd_knob_nearest(k[i].name) == &k[i]);
    }
    PD_CHECK(pd_knob_find("PD_CUDA_NO_SUCH_KNOB") == NULL);
    PD_CHECK(pd_knob_find("") == NULL);
}

static bool ok(const char *name, const char *v) {
    pd_err err = {0};
    const pd_knob *k = pd_knob_find(name);
    PD_CHECK_MSG(k != NULL, "%s not registered", name);
    if (!k) return false;
    pd_status st = pd_knob_check(k, v, &err);
    if (st) PD_CHECK_CONTAINS(err.msg, name);  // a refusal names the variable
    return st == PD_OK;
}

PD_TEST(values_by_kind) {
    // switch
    PD_CHECK(ok("PD_CUDA_PDL", "0") && ok("PD_CUDA_PDL", "1") && ok("PD_CUDA_PDL", ""));
    PD_CHECK(!ok("PD_CUDA_PDL", "2") && !ok("PD_CUDA_PDL", "on") && !ok("PD_CUDA_PDL", "01") && !ok("PD_CUDA_PDL", " 1"));
    // int, inclusive range
    PD_CHECK(ok("PD_CUDA_SKINNY", "0") && ok("PD_CUDA_SKINNY", "2"));
    PD_CHECK(!ok("PD_CUDA_SKINNY", "3") && !ok("PD_CUDA_SKINNY", "-1") && !ok("PD_CUDA_SKINNY", "1x") && !ok("PD_CUDA_SKINNY", "x"));
    PD_CHECK(ok("PD_CUDA_SKINNY_MMA_PIPE", "-1") && !ok("PD_CUDA_SKINNY_MMA_PIPE", "-2"));
    PD_CHECK(ok("PD_CUDA_ROPE_VEC_MIN", "1073741824") && !ok("PD_CUDA_ROPE_VEC_MIN", "1073741825"));
    PD_CHECK(!ok("PD_CUDA_ROPE_VEC_MIN", "99999999999999999999999"));  // overflow
    // float, (lo, hi]
    PD_CHECK(ok("PD_SPEC_PROBE_SHARE", "0.1") && ok("PD_SPEC_PROBE_SHARE", "0.003") && ok("PD_SPEC_PROBE_SHARE", "1e-3"));
    PD_CHECK(!ok("PD_SPEC_PROBE_SHARE", "0") && !ok("PD_SPEC_PROBE_SHARE", "0.2") && !ok("PD_SPEC_PROBE_SHARE", "nan") &&
             !ok("PD_SPEC_PROBE_SHARE", "0.01x") && !ok("PD_SPEC_PROBE_SHARE", "inf"));
    // choice: whole words only
    PD_CHECK(ok("PDSERVE_LOG", "debug") && ok("PDSERVE_LOG", "warn") && ok("PDSERVE_LOG", "info"));
    PD_CHECK(!ok("PDSERVE_LOG", "verbose") && !ok("PDSERVE_LOG", "deb") && !ok("PDSERVE_LOG", "debug|info") &&
             !ok("PDSERVE_LOG", "DEBUG"));
    PD_CHECK(ok("PD_CUDA_SAMPLE_CLUSTER", "16") && ok("PD_CUDA_SAMPLE_CLUSTER", "0") && !ok("PD_CUDA_SAMPLE_CLUSTER", "3") &&
             !ok("PD_CUDA_SAMPLE_CLUSTER", "32"));
    // text
    PD_CHECK(ok("PDSERVE_MODEL", "/any/path"));
}

PD_TEST(families_and_nearest) {
    PD_CHECK(pd_knob_family("PD_CUDA_X") && pd_knob_family("PDSERVE_X") && pd_knob_family("PD_SPEC_X") &&
             pd_knob_family("PD_MODEL_X") && pd_knob_family("PD_UCX_X"));
    // the test harness's own variables are not knobs and not of a knob family
    PD_CHECK(!pd_knob_family("PD_MODELS_DIR") && !pd_knob_family("PD_BIN") && !pd_knob_family("PD_REPO_DIR") &&
             !pd_knob_family("PD_KV_FAULT_CYCLES"));
    const pd_knob *k = pd_knob_nearest("PD_CUDA_ATTN_WAVE");
    PD_CHECK(k && !strcmp(k->name, "PD_CUDA_ATTN_WAVES"));
    k = pd_knob_nearest("PDSERVE_TIER_RESERV");
    PD_CHECK(k && !strcmp(k->name, "PDSERVE_TIER_RESERVE"));
    PD_CHECK(pd_knob_nearest("PD_CUDA_SOMETHING_ELSE_ENTIRELY") == NULL);
}

static int n_warned;
static char warned[4][64], nearest[4][64];
static void on_warn(const char *name, const pd_knob *k) {
    if (n_warned < 4) {
        snprintf(warned[n_warned], sizeof warned[0], "%s", name);
        snprintf(nearest[n_warned], sizeof nearest[0], "%s", k ? k->name : "");
    }
    n_warned++;
}

PD_TEST(environment_check) {
    char *good[] = {"HOME=/root", "PD_CUDA_PDL=1", "PD_MODELS_DIR=/x", "PD_BIN=/y", "PDSERVE_LOG=debug", "PD_CUDA_GRAPHS=",
                    "PD_CUDA_ATTN_WAVE=2", "PDSERVE_NO_SUCH=1", "NOEQUALS", "=x", NULL};
    pd_err err = {0};
    int n_unknown = -1;
    n_warned = 0;
    PD_CHECK_EQ(pd_knobs_check_env(good, &n_unknown, on_warn, &err), PD_OK);
    PD_CHECK_EQ(n_unknown, 2);
    PD_CHECK_EQ(n_warned, 2);
    PD_CHECK_STR(warned[0], "PD_CUDA_ATTN_WAVE");
    PD_CHECK_STR(nearest[0], "PD_CUDA_ATTN_WAVES");
    PD_CHECK_STR(warned[1], "PDSERVE_NO_SUCH");
    char *bad[] = {"PD_CUDA_PDL=1", "PDSERVE_TIER_RESERVE=yes", "PD_CUDA_SKINNY=9", NULL};
    PD_CHECK_EQ(pd_knobs_check_env(bad, NULL, NULL, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "PDSERVE_TIER_RESERVE=yes");
    PD_CHECK_EQ(pd_knobs_check_env(NULL, &n_unknown, NULL, &err), PD_OK);
    PD_CHECK_EQ(n_unknown, 0);
    // a name too long for the buffer is skipped, not truncated into a knob's name
    char longname[300];
    memset(longname, 'A', sizeof longname);
    memcpy(longname, "PD_CUDA_PDL", 11);
    memcpy(longname + 290, "=2", 3);
    char *lng[] = {longname, NULL};
    PD_CHECK_EQ(pd_knobs_check_env(lng, NULL, NULL, &err), PD_OK);
}

PD_TEST(env_double_is_strict) {
    pd_err err = {0};
    double v = -1;
    unsetenv("PD_TEST_KNOB_D");
    PD_CHECK_EQ(pd_env_double("PD_TEST_KNOB_D", 0.25, 0, 0.5, &v, &err), PD_OK);
    PD_CHECK_NEAR(v, 0.25, 0);
    setenv("PD_TEST_KNOB_D", "0.5", 1);
    PD_CHECK_EQ(pd_env_double("PD_TEST_KNOB_D", 0.25, 0, 0.5, &v, &err), PD_OK);
    PD_CHECK_NEAR(v, 0.5, 0);
    const char *bad[] = {"0", "0.6", "x", "0.1x", "nan", "-0.1", " "};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        setenv("PD_TEST_KNOB_D", bad[i], 1);
        v = -1;
        PD_CHECK_MSG(pd_env_double("PD_TEST_KNOB_D", 0.25, 0, 0.5, &v, &err) == PD_ERR_INVALID, "accepted '%s'", bad[i]);
        PD_CHECK_CONTAINS(err.msg, "PD_TEST_KNOB_D");
        PD_CHECK_NEAR(v, -1, 0);  // out untouched on refusal
    }
    unsetenv("PD_TEST_KNOB_D");
}
