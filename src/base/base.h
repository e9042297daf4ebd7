// base — the bottom layer of pdserve: status codes, error detail, the allocator, logging and
// assertions. Everything else includes this header; it includes only libc.
//
// Design:
//   * Expected outcomes (PD_AGAIN, PD_NOSPACE) are positive status codes; failures are negative.
//   * Human-facing failures (loading, parsing) carry detail in a caller-provided pd_err, which may be
//     NULL. Hot paths return a status only.
//   * All allocation goes through pd_malloc & co. They count live bytes (so tests can assert "no
//     leak") and, in FAULT builds, fail on a countdown (SQLite faultsim) so the fault tier can walk
//     every allocation site.
//   * PD_ASSERT is for proven invariants and stays on in release builds; it logs file:line and
//     aborts. Bad *input* never asserts: it returns an error.
//   * The only process-wide mutable state is the log level and the allocator counters, both set
//     once by cmd/ or by a test.
#pragma once

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_status {
    PD_OK = 0,
    PD_AGAIN = 1,    // would block / partial input: call again later
    PD_NOSPACE = 2,  // not enough KV blocks or slots: a scheduling signal, not an error
    PD_ERR_NOMEM = -1,
    PD_ERR_INVALID = -2,  // bad argument or request (HTTP 400 at the edge)
    PD_ERR_IO = -3,
    PD_ERR_PROTO = -4,  // malformed wire/HTTP/file input
    PD_ERR_CLOSED = -5,
    PD_ERR_TIMEOUT = -6,
    PD_ERR_DEVICE = -7,
    PD_ERR_NOTFOUND = -8,     // missing file, tensor, model (HTTP 404 at the edge)
    PD_ERR_UNSUPPORTED = -9,  // valid input we do not handle (unknown architecture, dtype)
} pd_status;

// Static string naming the status ("PD_ERR_INVALID"). Never NULL.
const char *pd_status_str(pd_status s);

// Error detail for human-facing failures. Zero-initialise or pass NULL.
typedef struct pd_err {
    pd_status status;
    char msg[512];
} pd_err;

// Sets err (if not NULL) and returns status, so callers can write `return pd_err_set(err, ...)`.
pd_status pd_err_set(pd_err *err, pd_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// ---- allocator -------------------------------------------------------------------------------
// Same contracts as malloc/calloc/realloc/free; pd_free(NULL) is a no-op. NULL on failure.
void *pd_malloc(size_t n_bytes);
void *pd_calloc(size_t n, size_t size);
void *pd_realloc(void *p, size_t n_bytes);
void pd_free(void *p);
char *pd_strdup(const char *s);              // out: owned by caller (pd_free)
char *pd_strndup(const char *s, size_t n);   // out: owned by caller (pd_free)
size_t pd_mem_used(void);                    // live bytes allocated through pd_malloc & co
size_t pd_mem_n_allocs(void);                // live allocations
// Fault injection (always compiled; costs one branch). After `countdown` more successful
// allocations, allocations fail; `persistent` keeps failing, otherwise only one fails.
// countdown < 0 disables. Returns how many allocations failed since the last call.
void pd_mem_fault_set(long countdown, bool persistent);
long pd_mem_fault_n_failed(void);

// ---- checked arithmetic for sizes read from untrusted input ------------------------------------
static inline bool pd_mul_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool pd_add_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_add_overflow(a, b, out);
}

// ---- logging -----------------------------------------------------------------------------------
typedef enum pd_log_level {
    PD_LOG_DEBUG = 0,
    PD_LOG_INFO = 1,
    PD_LOG_WARN = 2,
    PD_LOG_ERROR = 3,
    PD_LOG_NONE = 4,
} pd_log_level;
void pd_log_set_level(pd_log_level lvl);
pd_log_level pd_log_get_level(void);
void pd_log(pd_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define PD_LOG_D(...) pd_log(PD_LOG_DEBUG, __VA_ARGS__)
#define PD_LOG_I(...) pd_log(PD_LOG_INFO, __VA_ARGS__)
#define PD_LOG_W(...) pd_log(PD_LOG_WARN, __VA_ARGS__)
#define PD_LOG_E(...) pd_log(PD_LOG_ERROR, __VA_ARGS__)

// ---- assertions --------------------------------------------------------------------------------
_Noreturn void pd_abort(const char *file, int line, const char *func, const char *what);
#define PD_ASSERT(x) \
    do { if (!(x)) pd_abort(__FILE__, __LINE__, __func__, #x); } while (0)
#ifdef PD_DEBUG
#define PD_DEBUG_ASSERT(x) PD_ASSERT(x)
#else
#define PD_DEBUG_ASSERT(x) ((void)0)
#endif
// "Believed impossible, but handle it anyway": true when x holds (and aborts in debug builds).
#ifdef PD_DEBUG
#define PD_NEVER(x) ((x) ? (pd_abort(__FILE__, __LINE__, __func__, #x), 1) : 0)
#else
#define PD_NEVER(x) (x)
#endif

#define PD_UNUSED(x) ((void)(x))
#define PD_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define PD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PD_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PD_CONTAINER_OF(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

// ---- time --------------------------------------------------------------------------------------
int64_t pd_time_us(void);  // monotonic microseconds

// ---- numbers from text ----
// s is a whole decimal number in [lo, hi] (no sign-less junk, no trailing text, no overflow).
bool pd_parse_int_in(const char *s, long long lo, long long hi, long long *out);
// s is a finite decimal number in (lo, hi] (no trailing text).
bool pd_parse_double_in(const char *s, double lo, double hi, double *out);

// ---- environment switches ----------------------------------------------------------------------
// A 0/1 switch read from the environment (measurement and A/B knobs): unset or empty -> dflt, "0" or
// "1" -> that value; anything else is PD_ERR_INVALID with err naming the variable and its value, so
// a mistyped knob is refused instead of silently meaning "default".
pd_status pd_env_switch(const char *name, bool dflt, bool *out, pd_err *err);
// An integer knob in [lo, hi] from the environment: unset or empty -> dflt; anything else than a
// whole decimal number in range is PD_ERR_INVALID with err naming the variable and the range.
pd_status pd_env_int(const char *name, int dflt, int lo, int hi, int *out, pd_err *err);
// A number knob in (lo, hi] from the environment: unset or empty -> dflt; anything else than a whole
// decimal number in range is PD_ERR_INVALID with err naming the variable and the range.
pd_status pd_env_double(const char *name, double dflt, double lo, double hi, double *out, pd_err *err);

// ---- files -------------------------------------------------------------------------------------
// Reads a whole file into a NUL-terminated buffer. out: owned by caller (pd_free).
// PD_ERR_NOTFOUND if it does not exist, PD_ERR_IO otherwise; err names the path.
pd_status pd_file_read_all(const char *path, char **out, size_t *out_len, pd_err *err);
// Joins dir and name with one '/'. out: owned by caller (pd_free); NULL on OOM.
char *pd_path_join(const char *dir, const char *name);

// ---- numbers -----------------------------------------------------------------------------------
// bf16/f16 <-> f32 conversions (round-to-nearest-even for bf16).
static inline float pd_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t pd_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  // NaN stays NaN
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}
float pd_f16_to_f32(uint16_t h);
uint16_t pd_f32_to_f16(float f);

// Seedable PRNG (xoshiro256**): reproducible sampling and test data.
typedef struct pd_rng {
    uint64_t s[4];
} pd_rng;
void pd_rng_seed(pd_rng *r, uint64_t seed);
uint64_t pd_rng_next(pd_rng *r);
double pd_rng_uniform(pd_rng *r);  // [0, 1)
float pd_rng_normal(pd_rng *r);    // N(0,1)

#ifdef __cplusplus
}
#endif
