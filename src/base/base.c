// base.c — status strings, error detail, counting allocator with fault injection, logging,
// assertions, time, files, half-precision conversion and the PRNG.
//
// The allocator prepends a 16-byte header holding the size, so pd_mem_used() is exact and a test
// can assert that a load/free cycle returns to the same count. Counters are atomics because the
// event-loop thread and the engine thread both allocate.
#include "base.h"
#include "buf.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *pd_status_str(pd_status s) {
    switch (s) {
    case PD_OK: return "PD_OK";
    case PD_AGAIN: return "PD_AGAIN";
    case PD_NOSPACE: return "PD_NOSPACE";
    case PD_ERR_NOMEM: return "PD_ERR_NOMEM";
    case PD_ERR_INVALID: return "PD_ERR_INVALID";
    case PD_ERR_IO: return "PD_ERR_IO";
    case PD_ERR_PROTO: return "PD_ERR_PROTO";
    case PD_ERR_CLOSED: return "PD_ERR_CLOSED";
    case PD_ERR_TIMEOUT: return "PD_ERR_TIMEOUT";
    case PD_ERR_DEVICE: return "PD_ERR_DEVICE";
    case PD_ERR_NOTFOUND: return "PD_ERR_NOTFOUND";
    case PD_ERR_UNSUPPORTED: return "PD_ERR_UNSUPPORTED";
    }
    return "PD_ERR_UNKNOWN";
}

pd_status pd_err_set(pd_err *err, pd_status status, const char *fmt, ...) {
    if (err) {
        err->status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return status;
}

// ---- allocator -------------------------------------------------------------------------------
#define HDR 16  // keeps 16-byte alignment of the user pointer

static size_t g_used, g_n_allocs;
static long g_fault_countdown = -1, g_fault_n_failed;
static bool g_fault_persistent;

static bool fault_fire(void) {
    long c = __atomic_load_n(&g_fault_countdown, __ATOMIC_RELAXED);
    if (c < 0) return false;
    if (c > 0) {
        __atomic_sub_fetch(&g_fault_countdown, 1, __ATOMIC_RELAXED);
        return false;
    }
    __atomic_add_fetch(&g_fault_n_failed, 1, __ATOMIC_RELAXED);
    if (!g_fault_persistent) __atomic_store_n(&g_fault_countdown, -1, __ATOMIC_RELAXED);
    return true;
}

void pd_mem_fault_set(long countdown, bool persistent) {
    g_fault_persistent = persistent;
    __atomic_store_n(&g_fault_n_failed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_fault_countdown, countdown, __ATOMIC_RELAXED);
}
long pd_mem_fault_n_failed(void) { return __atomic_load_n(&g_fault_n_failed, __ATOMIC_RELAXED); }

void *pd_malloc(size_t n) {
    if (fault_fire()) return NULL;
    if (n > SIZE_MAX - HDR) return NULL;
    unsigned char *p = malloc(n + HDR);
    if (!p) return NULL;
    memcpy(p, &n, sizeof n);
    __atomic_add_fetch(&g_used, n, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_n_allocs, 1, __ATOMIC_RELAXED);
    return p + HDR;
}

void *pd_calloc(size_t n, size_t size) {
    size_t total;
    if (pd_mul_overflow(n, size, &total)) return NULL;
    void *p = pd_malloc(total);
    if (p) memset(p, 0, total);
    return p;
}

void pd_free(void *p) {
    if (!p) return;
    unsigned char *h = (unsigned char *)p - HDR;
    size_t n;
    memcpy(&n, h, sizeof n);
    __atomic_sub_fetch(&g_used, n, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&g_n_allocs, 1, __ATOMIC_RELAXED);
    free(h);
}

void *pd_realloc(void *p, size_t n) {
    if (!p) return pd_malloc(n);
    if (fault_fire()) return NULL;
    if (n > SIZE_MAX - HDR) return NULL;
    unsigned char *h = (unsigned char *)p - HDR;
    size_t old;
    memcpy(&old, h, sizeof old);
    unsigned char *nh = realloc(h, n + HDR);
    if (!nh) return NULL;
    memcpy(nh, &n, sizeof n);
    __atomic_add_fetch(&g_used, n, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&g_used, old, __ATOMIC_RELAXED);
    return nh + HDR;
}

char *pd_strndup(const char *s, size_t n) {
    char *d = pd_malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}
char *pd_strdup(const char *s) { return pd_strndup(s, strlen(s)); }
size_t pd_mem_used(void) { return __atomic_load_n(&g_used, __ATOMIC_RELAXED); }
size_t pd_mem_n_allocs(void) { return __atomic_load_n(&g_n_allocs, __ATOMIC_RELAXED); }

// ---- logging -----------------------------------------------------------------------------------
static pd_log_level g_log_level = PD_LOG_INFO;
void pd_log_set_level(pd_log_level lvl) { g_log_level = lvl; }
pd_log_level pd_log_get_level(void) { return g_log_level; }

void pd_log(pd_log_level lvl, const char *fmt, ...) {
    if (lvl < g_log_level) return;
    static const char *names[] = {"debug", "info", "warn", "error", ""};
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    // One fprintf per line so lines from different threads do not interleave.
    if (lvl == PD_LOG_DEBUG) fprintf(stderr, "pdserve %s [%.6f]: %s\n", names[lvl], (double)pd_time_us() / 1e6, line);
    else fprintf(stderr, "pdserve %s: %s\n", names[lvl], line);
}

_Noreturn void pd_abort(const char *file, int line, const char *func, const char *what) {
    fprintf(stderr, "%s:%d %s: assertion failed: %s\n", file, line, func, what);
    fflush(stderr);
    abort();
}

int64_t pd_time_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// ---- files -------------------------------------------------------------------------------------
pd_status pd_env_switch(const char *name, bool dflt, bool *out, pd_err *err) {
    const char *v = getenv(name);
    if (!v || !*v) {
        *out = dflt;
        return PD_OK;
    }
    if (!strcmp(v, "0") || !strcmp(v, "1")) {
        *out = v[0] == '1';
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_INVALID, "%s=%s: want 0 or 1", name, v);
}

bool pd_parse_int_in(const char *s, long long lo, long long hi, long long *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool pd_parse_double_in(const char *s, double lo, double hi, double *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || !(v > lo && v <= hi)) return false;
    *out = v;
    return true;
}

pd_status pd_env_int(const char *name, int dflt, int lo, int hi, int *out, pd_err *err) {
    const char *e = getenv(name);
    long long v = dflt;
    if (e && *e && !pd_parse_int_in(e, lo, hi, &v))
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: expected an integer in [%d, %d]", name, e, lo, hi);
    *out = (int)v;
    return PD_OK;
}

pd_status pd_env_double(const char *name, double dflt, double lo, double hi, double *out, pd_err *err) {
    const char *e = getenv(name);
    double v = dflt;
    if (e && *e && !pd_parse_double_in(e, lo, hi, &v))
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: expected a number in (%g, %g]", name, e, lo, hi);
    *out = v;
    return PD_OK;
}

pd_status pd_file_read_all(const char *path, char **out, size_t *out_len, pd_err *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        return pd_err_set(err, e == ENOENT ? PD_ERR_NOTFOUND : PD_ERR_IO, "%s: %s", path,
                          strerror(e));
    }
    pd_buf b = {0};
    for (;;) {
        if (pd_buf_reserve(&b, 4096) != PD_OK) goto nomem;
        size_t n = fread(b.p + b.len, 1, b.cap - b.len - 1, f);
        b.len += n;
        if (n == 0) break;
    }
    if (ferror(f)) {
        pd_buf_free(&b);
        fclose(f);
        return pd_err_set(err, PD_ERR_IO, "%s: read error", path);
    }
    fclose(f);
    b.p[b.len] = 0;
    if (out_len) *out_len = b.len;
    *out = b.p;
    return PD_OK;
nomem:
    pd_buf_free(&b);
    fclose(f);
    return pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory", path);
}

char *pd_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    bool slash = a > 0 && dir[a - 1] != '/';
    char *p = pd_malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    if (slash) p[a++] = '/';
    memcpy(p + a, name, b + 1);
    return p;
}

// ---- half precision ----------------------------------------------------------------------------
float pd_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        // subnormal or zero: value = mant * 2^-24
        float f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return v.f;
}

uint16_t pd_f32_to_f16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    uint32_t sign = (v.u >> 16) & 0x8000;
    float a = fabsf(f);
    if (isnan(f)) return (uint16_t)(sign | 0x7e00);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00);
    if (a < 6.103515625e-05f) {  // subnormal range: round to a multiple of 2^-24
        uint32_t m = (uint32_t)lrintf(a * 16777216.0f);
        return (uint16_t)(sign | m);
    }
    uint32_t u = v.u & 0x7fffffffu;
    uint32_t exp = (u >> 23) - 112, mant = u & 0x7fffff;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

// ---- PRNG (xoshiro256**, seeded through splitmix64) -------------------------------------------
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
void pd_rng_seed(pd_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
uint64_t pd_rng_next(pd_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}
double pd_rng_uniform(pd_rng *r) { return (double)(pd_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }
float pd_rng_normal(pd_rng *r) {
    double u1 = pd_rng_uniform(r), u2 = pd_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
